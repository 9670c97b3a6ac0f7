// The __nv_bfloat16 instantiations of the paged prefill kernel (one file per dtype so that ninja builds them in
// parallel).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_bf16(int head_dim, int config) {
  return prefill::select_kernel<__nv_bfloat16>(head_dim, config);
}

}  // namespace hf_paged
