// The paged-decode kernels over an e4m3 (float8_e4m3fn) cache, for fp16 and bf16 queries (tensor cores).
#include "paged_decode_mma_kernel.cuh"

namespace hf_paged {

DecodeKernel decode_kernel_f16_e4m3(int head_dim) { return decode::select_mma_e4m3_kernel<__half>(head_dim); }

DecodeKernel decode_kernel_bf16_e4m3(int head_dim) {
  return decode::select_mma_e4m3_kernel<__nv_bfloat16>(head_dim);
}

}  // namespace hf_paged
