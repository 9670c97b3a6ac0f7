// One-shot sum over the ranks of a tensor-parallel group through peer-mapped buffers (layout and protocol in
// peer_sum.h).
//
// Ordering. A block's threads write its units into this rank's buffer, meet at a barrier, and then one thread per
// peer stores the epoch into that peer's flags with st.release.sys: the barrier orders the block's writes before the
// release, which publishes them to a peer that reads the flag with ld.acquire.sys and then passes its own barrier.
// Peer data is read with ld.global.cg (L2, never a stale L1 line).
//
// Reuse without a closing barrier. Calls alternate between the two data halves. Before call e writes half e % 2,
// block b has seen every peer's epoch e - 1 flag for block b, so every peer has started call e - 1 and, its calls
// being ordered on one stream, finished call e - 2: the last reader of half e % 2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "block_sum.cuh"
#include "peer_sum.h"
#include "vec.cuh"

namespace hf_paged {
namespace {

__device__ __forceinline__ void store_release_sys(uint64_t* addr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint4 load_cg(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 r;
  T* dst = reinterpret_cast<T*>(&r);
  constexpr int kVec = Elem<T>::kVec;
#pragma unroll
  for (int i = 0; i < kVec; i += 4) Elem<T>::store4(dst + i, make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]));
  return r;
}

// The float32 sum of unit i over the ranks, in rank order (this rank's own from `in`, the others' from their staged
// half): every rank computes the same bits.
template <typename T>
__device__ __forceinline__ void sum_unit(const PeerSumArgs& a, int64_t half, int64_t i, float* acc) {
  constexpr int kVec = Elem<T>::kVec;
  float part[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
  for (int r = 0; r < a.world_size; ++r) {
    const uint4 v = r == a.rank ? static_cast<const uint4*>(a.in)[i]
                                : load_cg(reinterpret_cast<const uint4*>(
                                      reinterpret_cast<const uint8_t*>(a.buffers[r]) + half) + i);
    Elem<T>::unpack(v, part);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] += part[j];
  }
}

// acc = T(residual + T(acc)) as floats, and that unit packed: the unfused layer rounds the sum to T, then adds.
template <typename T>
__device__ __forceinline__ uint4 add_residual(const PeerSumArgs& a, int64_t i, float* acc) {
  constexpr int kVec = Elem<T>::kVec;
  float res[kVec];
  Elem<T>::unpack(pack<T>(acc), acc);
  Elem<T>::unpack(static_cast<const uint4*>(a.residual)[i], res);
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] += res[j];
  const uint4 h = pack<T>(acc);
  Elem<T>::unpack(h, acc);
  return h;
}

// kNorm false: units split evenly over the blocks (out = the sum, plus the residual where given). kNorm true: whole
// rows per block, out = residual + sum and norm_out = its RMSNorm.
template <typename T, bool kNorm>
__global__ void __launch_bounds__(kPeerSumThreads) peer_sum_kernel(const PeerSumArgs a) {
  constexpr int kVec = Elem<T>::kVec;
  const int b = blockIdx.x;
  uint8_t* mine = reinterpret_cast<uint8_t*>(a.buffers[a.rank]);
  uint64_t* my_flags = reinterpret_cast<uint64_t*>(mine + 2 * a.half_bytes);
  uint64_t* epochs = my_flags + kPeerSumBlocks * kPeerSumMaxRanks;

  __shared__ uint64_t epoch_shared;
  __shared__ float scratch[kPeerSumThreads / 32];
  if (threadIdx.x == 0) {
    const uint64_t e = epochs[b] + 1;  // only this block of this rank touches epochs[b]
    epochs[b] = e;
    epoch_shared = e;
  }
  __syncthreads();
  const uint64_t epoch = epoch_shared;
  const int64_t half = static_cast<int64_t>(epoch & 1) * a.half_bytes;

  const uint4* in = static_cast<const uint4*>(a.in);
  uint4* staged = reinterpret_cast<uint4*>(mine + half);
  const int64_t first = static_cast<int64_t>(b) * kPeerSumThreads + threadIdx.x;
  constexpr int64_t kStride = static_cast<int64_t>(kPeerSumBlocks) * kPeerSumThreads;
  const int64_t rows = kNorm ? a.n16 / a.row_units : 0;
  if constexpr (kNorm) {
    for (int64_t r = b; r < rows; r += kPeerSumBlocks) {
      for (int j = threadIdx.x; j < a.row_units; j += kPeerSumThreads) {
        staged[r * a.row_units + j] = in[r * a.row_units + j];
      }
    }
  } else {
    for (int64_t i = first; i < a.n16; i += kStride) staged[i] = in[i];
  }
  __syncthreads();

  const int peer = threadIdx.x;
  if (peer < a.world_size && peer != a.rank) {
    uint8_t* theirs = reinterpret_cast<uint8_t*>(a.buffers[peer]);
    uint64_t* their_flags = reinterpret_cast<uint64_t*>(theirs + 2 * a.half_bytes);
    store_release_sys(their_flags + b * kPeerSumMaxRanks + a.rank, epoch);
    const uint64_t* flag = my_flags + b * kPeerSumMaxRanks + peer;
    const uint64_t began = a.timeout_ns ? global_timer_ns() : 0;
    while (load_acquire_sys(flag) < epoch) {
      if (a.timeout_ns && global_timer_ns() - began > a.timeout_ns) __trap();  // a peer never came: fail, not hang
    }
  }
  __syncthreads();

  uint4* out = static_cast<uint4*>(a.out);
  if constexpr (!kNorm) {
    for (int64_t i = first; i < a.n16; i += kStride) {
      float acc[kVec];
      sum_unit<T>(a, half, i, acc);
      out[i] = a.residual ? add_residual<T>(a, i, acc) : pack<T>(acc);
    }
  } else {
    const uint4* weight = static_cast<const uint4*>(a.weight);
    uint4* norm_out = static_cast<uint4*>(a.norm_out);
    const float hidden = static_cast<float>(a.row_units * kVec);
    for (int64_t r = b; r < rows; r += kPeerSumBlocks) {
      float h[kPeerSumMaxRowUnitsPerThread][kVec];
      float squares = 0.f;
#pragma unroll
      for (int k = 0; k < kPeerSumMaxRowUnitsPerThread; ++k) {
        const int j = threadIdx.x + k * kPeerSumThreads;
        if (j < a.row_units) {
          const int64_t i = r * a.row_units + j;
          sum_unit<T>(a, half, i, h[k]);
          out[i] = add_residual<T>(a, i, h[k]);
#pragma unroll
          for (int e = 0; e < kVec; ++e) squares += h[k][e] * h[k][e];
        }
      }
      // mean(h^2) as the unfused layer takes it (a float32 sum over the row, divided by its size); rounding order
      // aside, the same float32 math
      const float rstd = rsqrtf(block_sum<kPeerSumThreads>(squares, scratch) / hidden + a.eps);
#pragma unroll
      for (int k = 0; k < kPeerSumMaxRowUnitsPerThread; ++k) {
        const int j = threadIdx.x + k * kPeerSumThreads;
        if (j < a.row_units) {
          float y[kVec], w[kVec];
#pragma unroll
          for (int e = 0; e < kVec; ++e) y[e] = h[k][e] * rstd;
          Elem<T>::unpack(pack<T>(y), y);  // T(h * rstd), then the weight: T(weight * T(h * rstd))
          Elem<T>::unpack(weight[j], w);
#pragma unroll
          for (int e = 0; e < kVec; ++e) y[e] *= w[e];
          norm_out[r * a.row_units + j] = pack<T>(y);
        }
      }
    }
  }
}

template <typename T>
void launch(const PeerSumArgs& args, cudaStream_t stream) {
  const dim3 grid(kPeerSumBlocks), block(kPeerSumThreads);
  if (args.weight) {
    peer_sum_kernel<T, true><<<grid, block, 0, stream>>>(args);
  } else {
    peer_sum_kernel<T, false><<<grid, block, 0, stream>>>(args);
  }
}

}  // namespace

cudaError_t launch_peer_sum(const PeerSumArgs& args, int dtype, cudaStream_t stream) {
  if (dtype == 0) {
    launch<float>(args, stream);
  } else if (dtype == 1) {
    launch<__half>(args, stream);
  } else {
    launch<__nv_bfloat16>(args, stream);
  }
  return cudaGetLastError();
}

}  // namespace hf_paged
