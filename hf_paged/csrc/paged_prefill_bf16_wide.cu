// The __nv_bfloat16 paged prefill kernels from head size kPrefillWideHeadDim up (paged_prefill_bf16.cu has the
// smaller ones).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_bf16_wide(int head_dim, int config) {
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 112: return prefill::kernel_for_config<__nv_bfloat16, 112>(config);
    case 128: return prefill::kernel_for_config<__nv_bfloat16, 128>(config);
    case 160: return prefill::kernel_for_config<__nv_bfloat16, 160>(config);
    case 192: return prefill::kernel_for_config<__nv_bfloat16, 192>(config);
    case 256: return prefill::kernel_for_config<__nv_bfloat16, 256>(config);
    default: return PrefillKernel{};
  }
}

}  // namespace hf_paged
