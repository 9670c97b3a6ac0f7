// The float32 paged-decode kernels (CUDA cores; used by tests and float32 models).
#include "paged_decode_simt.cuh"

namespace hf_paged {

DecodeKernel decode_kernel_f32(int head_dim, int group_size) {
  return decode::select_simt_kernel<float>(head_dim, group_size);
}

}  // namespace hf_paged
