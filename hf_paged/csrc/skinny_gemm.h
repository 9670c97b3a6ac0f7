// Plain C++ interface between the skinny-GEMM ops (skinny_ops.cpp) and their kernel (skinny_gemm.cu, up to 8 rows of
// x); no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

// Rows of x one launch serves: the x rows are the n side (8 wide) of one m16n8k16 tensor-core product.
constexpr int kSkinnyMaxRows = 8;
// Weights one launch serves (products sharing x: q/k/v, gate/up).
constexpr int kSkinnyMaxGroup = 4;

// out_i[M, N_i] = x[M, K] @ weight_i[N_i, K]^T (+ bias_i) for i < count, fp32 accumulation, rounded to the inputs'
// dtype. One weight is the plain linear layer.
struct SkinnyGemmParams {
  const void* x;                          // [M, K], rows x_stride elements apart, every row 16-byte aligned
  const void* weight[kSkinnyMaxGroup];    // [N_i, K] contiguous, 16-byte aligned; K a multiple of 8
  const void* bias[kSkinnyMaxGroup];      // [N_i] or nullptr
  void* out[kSkinnyMaxGroup];             // [M, N_i] contiguous
  int n[kSkinnyMaxGroup];                 // N_i >= 1
  int count;                              // 1 <= count <= kSkinnyMaxGroup
  int64_t x_stride;
  int m, k;                               // 1 <= m <= kSkinnyMaxRows, k >= 0
  bool bf16;                              // else float16
  int sms;                                // the device's multiprocessor count (sizes the split of K)
  bool clusters;  // thread-block clusters available (sm_90+): K may be split across the blocks of a cluster
};

cudaError_t launch_skinny_gemm(const SkinnyGemmParams& p, cudaStream_t stream);

}  // namespace hf_paged
