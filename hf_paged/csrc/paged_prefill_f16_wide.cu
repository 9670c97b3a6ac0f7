// The __half paged prefill kernels from head size kPrefillWideHeadDim up (paged_prefill_f16.cu has the
// smaller ones).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_f16_wide(int head_dim, int config) {  // head sizes: kernels.HEAD_DIMS in Python
  return prefill::select_head_dim<__half, __half, 112, 128, 160, 192, 256>(head_dim, config);
}

}  // namespace hf_paged
