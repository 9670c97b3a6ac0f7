// The __half paged prefill kernels over an e4m3 (float8_e4m3fn) cache (paged_prefill_fp8.cuh): head sizes 64, 128
// and 256, every tile configuration compiled for them. One file per query dtype, so that ninja builds them in parallel.
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_f16_e4m3(int head_dim, int config) {  // kernels.FP8_HEAD_DIMS in Python
  return prefill::select_head_dim<__half, E4M3, 64, 128, 256>(head_dim, config);
}

}  // namespace hf_paged
