// The __half paged prefill kernels from head size kPrefillWideHeadDim up (paged_prefill_f16.cu has the
// smaller ones).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_f16_wide(int head_dim, int config) {
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 112: return prefill::kernel_for_config<__half, 112>(config);
    case 128: return prefill::kernel_for_config<__half, 128>(config);
    case 160: return prefill::kernel_for_config<__half, 160>(config);
    case 192: return prefill::kernel_for_config<__half, 192>(config);
    case 256: return prefill::kernel_for_config<__half, 256>(config);
    default: return PrefillKernel{};
  }
}

}  // namespace hf_paged
