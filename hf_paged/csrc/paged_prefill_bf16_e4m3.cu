// The __nv_bfloat16 paged prefill kernels over an e4m3 (float8_e4m3fn) cache (paged_prefill_fp8.cuh): head sizes 64,
// 128 and 256, every tile configuration compiled for them (paged_prefill_f16_e4m3.cu has the fp16 ones).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_bf16_e4m3(int head_dim, int config) {  // kernels.FP8_HEAD_DIMS in Python
  return prefill::select_head_dim<__nv_bfloat16, E4M3, 64, 128, 256>(head_dim, config);
}

}  // namespace hf_paged
