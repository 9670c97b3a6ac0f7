// One armed decode step of a fixed-shape (compiled) generate, in one launch: every row gains a token.
//
// For row i of B: seq_lens[i] += 1, cu_seqlens_k[i + 1] += i + 1 (the prefix sums of lengths that each grew by one),
// position[i] += 1 and slot_mapping[i] = slot_of[i, position[i]] (the slot the armed block table gives that
// position). What four torch ops did, at one launch's host cost: on a CPU-bound decode step the host time before
// the CUDA graph launches is what the GPU waits for.
#include "launch.h"

namespace hf_paged {
namespace {

constexpr int kStepThreads = 128;

__global__ void __launch_bounds__(kStepThreads)
    advance_decode_kernel(int32_t* __restrict__ seq_lens, int32_t* __restrict__ cu_seqlens_k,
                          int64_t* __restrict__ position, const int64_t* __restrict__ slot_of,
                          int64_t* __restrict__ slot_mapping, int rows, int64_t slot_stride) {
  const int i = blockIdx.x * kStepThreads + threadIdx.x;
  if (i >= rows) return;
  seq_lens[i] += 1;
  cu_seqlens_k[i + 1] += i + 1;
  const int64_t p = position[i] + 1;
  position[i] = p;
  slot_mapping[i] = slot_of[i * slot_stride + p];
}

}  // namespace

cudaError_t launch_advance_decode(int32_t* seq_lens, int32_t* cu_seqlens_k, int64_t* position, const int64_t* slot_of,
                                  int64_t* slot_mapping, int rows, int64_t slot_stride, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int blocks = (rows + kStepThreads - 1) / kStepThreads;
  advance_decode_kernel<<<blocks, kStepThreads, 0, stream>>>(seq_lens, cu_seqlens_k, position, slot_of, slot_mapping,
                                                              rows, slot_stride);
  return cudaGetLastError();
}

}  // namespace hf_paged
