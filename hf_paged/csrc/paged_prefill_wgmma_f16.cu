// The __half wgmma prefill kernels (Hopper). Built for sm_90a only: kernels/_build.py defines HF_PAGED_SM90A
// with that target; any other build compiles just the stub below, and the op refuses the configuration.
#include "paged_prefill.cuh"

#ifdef HF_PAGED_SM90A
#include "paged_prefill_wgmma.cuh"
#endif

namespace hf_paged {

PrefillKernel prefill_kernel_wgmma_f16(int head_dim, bool pipelined) {  // head sizes: kernels.prefill.WGMMA_HEAD_DIMS in Python
#ifdef HF_PAGED_SM90A
  return prefill_wgmma::select_head_dim<__half, 32, 64, 80, 96, 112, 128, 160, 192, 256>(head_dim, pipelined);
#else
  (void)head_dim, (void)pipelined;
  return PrefillKernel{};
#endif
}

}  // namespace hf_paged
