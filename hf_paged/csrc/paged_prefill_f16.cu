// The __half paged prefill kernels for head sizes below kPrefillWideHeadDim (the others are in
// paged_prefill_f16_wide.cu: several files so that ninja builds them in parallel).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_f16(int head_dim, int config) {  // head sizes: kernels.HEAD_DIMS in Python
  return prefill::select_head_dim<__half, __half, 32, 64, 80, 96>(head_dim, config);
}

}  // namespace hf_paged
