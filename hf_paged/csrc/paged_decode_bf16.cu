// The __nv_bfloat16 paged-decode kernels (tensor cores; one file per dtype so that ninja compiles them in parallel).
#include "paged_decode_mma_kernel.cuh"

namespace hf_paged {

DecodeKernel decode_kernel_bf16(int head_dim, int /*group_size: up to 16 heads share one CTA*/) {
  return decode::select_mma_kernel<__nv_bfloat16>(head_dim);
}

}  // namespace hf_paged
