// Plain C++ interface between the skinny-GEMM op (skinny_ops.cpp) and its kernel (skinny_gemm.cu); no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

// Rows of x one launch serves: the x rows are the n side (8 wide) of one m16n8k16 tensor-core product.
constexpr int kSkinnyMaxRows = 8;

// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), fp32 accumulation, rounded to the inputs' dtype.
struct SkinnyGemmParams {
  const void* x;       // [M, K], rows x_stride elements apart, every row 16-byte aligned
  const void* weight;  // [N, K] contiguous, 16-byte aligned; K a multiple of 8
  const void* bias;    // [N] or nullptr
  void* out;           // [M, N] contiguous
  int64_t x_stride;
  int m, n, k;         // 1 <= m <= kSkinnyMaxRows, n >= 1, k >= 0
  bool bf16;           // else float16
  int sms;             // the device's multiprocessor count (sizes the split of K)
  bool clusters;       // thread-block clusters available (sm_90+): K may be split across the blocks of a cluster
};

cudaError_t launch_skinny_gemm(const SkinnyGemmParams& p, cudaStream_t stream);

}  // namespace hf_paged
