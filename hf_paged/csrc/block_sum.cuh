// The sum of one float over a thread block, the same in every thread.
#pragma once

namespace hf_paged {

// Every thread of a block of kThreads (a multiple of 32) calls it with its value; each gets the block's sum, added in
// the same order in every thread. scratch: kThreads / 32 floats of shared memory, reusable right after the call (the
// first barrier waits for the previous call's readers).
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

}  // namespace hf_paged
