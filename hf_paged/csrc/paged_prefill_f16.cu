// The __half paged prefill kernels for head sizes below kPrefillWideHeadDim (the others are in
// paged_prefill_f16_wide.cu; several files so that ninja builds them in parallel).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_f16(int head_dim, int config) {
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 32: return prefill::kernel_for_config<__half, 32>(config);
    case 64: return prefill::kernel_for_config<__half, 64>(config);
    case 80: return prefill::kernel_for_config<__half, 80>(config);
    case 96: return prefill::kernel_for_config<__half, 96>(config);
    default: return PrefillKernel{};
  }
}

}  // namespace hf_paged
