// The __nv_bfloat16 paged prefill kernels for head sizes below kPrefillWideHeadDim (the others are in
// paged_prefill_bf16_wide.cu; several files so that ninja builds them in parallel).
#include "paged_prefill_kernel.cuh"

namespace hf_paged {

PrefillKernel prefill_kernel_bf16(int head_dim, int config) {
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 32: return prefill::kernel_for_config<__nv_bfloat16, 32>(config);
    case 64: return prefill::kernel_for_config<__nv_bfloat16, 64>(config);
    case 80: return prefill::kernel_for_config<__nv_bfloat16, 80>(config);
    case 96: return prefill::kernel_for_config<__nv_bfloat16, 96>(config);
    default: return PrefillKernel{};
  }
}

}  // namespace hf_paged
