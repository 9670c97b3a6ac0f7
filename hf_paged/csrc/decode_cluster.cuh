// The split-K combine of paged decode inside a thread-block cluster (compute capability 9.0 on; opt-in,
// HF_PAGED_DECODE_CLUSTER=1, decode_launch.cpp).
//
// The plain kernel ends each split by storing its partial to global memory, taking a ticket (an acquire-release
// atomic), and the last split to arrive reads every partial back and writes the output: three dependent
// memory round trips after the slowest split streamed its K/V. A B=1 x 8192 decode is 17.7 us on an H100 where its
// bytes take 11.1 us (docs/kernels.md, "Where B=1 x 8192 spends its time"), and this tail is part of the rest.
//
// Here the splits of one (sequence, head group) are one cluster (grid x = the split count = the cluster size, so
// cluster rank r is split r). Each CTA merges its warps into a partial in its own shared memory (ClusterPartial,
// behind the Reduce area), the cluster synchronizes once, rank 0 reads the partials of splits 0 .. n-1 of its
// sequence through distributed shared memory and writes the output, and a second cluster barrier keeps every CTA's
// shared memory alive until rank 0 has read it. CTAs past their sequence's last split take part in both barriers
// and nothing else. The arithmetic is the plain kernel's own functions (merge_warps, then merge_batch over the
// splits in order), so the output is the same bit for bit; no workspace and no tickets are touched.
#pragma once

#include <cooperative_groups.h>

#include "decode_common.cuh"

namespace hf_paged {
namespace decode {

// This CTA's merged partial: [GT][D] unnormalised output, then [GT] max (log2 units) and [GT] sum, after the Reduce
// area (which the merge reads while it writes here).
template <int D, int GT>
struct ClusterPartial {
  static constexpr int kOffset = Reduce<D, GT>::kBytes;
  static constexpr int kBytes = GT * (D + 2) * 4;
  __device__ static float* acc(unsigned char* smem) { return reinterpret_cast<float*>(smem + kOffset); }
  __device__ static float* m(unsigned char* smem) { return acc(smem) + GT * D; }
  __device__ static float* l(unsigned char* smem) { return m(smem) + GT; }
};

// A CTA with no split of its sequence: its part of both cluster barriers.
__device__ __forceinline__ void cluster_finish_empty() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();
  cluster.sync();
#endif
}

// After the warps' states are in shared memory (Reduce layout, behind a barrier): merge them into this CTA's
// partial, then combine the cluster's partials on rank 0.
template <typename T, int D, int GT>
__device__ void cluster_finish(const DecodeParams& p, unsigned char* smem, const CtaWork& w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using P = ClusterPartial<D, GT>;
  for (int idx = threadIdx.x; idx < w.valid_heads * D / 4; idx += kThreads) {
    const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
    float m, l;
    float4 o;
    merge_warps<D, GT>(smem, g, d, m, l, o);
    *reinterpret_cast<float4*>(P::acc(smem) + g * D + d) = o;
    if (d == 0) P::m(smem)[g] = m, P::l(smem)[g] = l;
  }
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every split's partial is in its CTA's shared memory (release / acquire at cluster scope)
  if (threadIdx.x == 0) trace_point(p, kTraceTicket);
  if (cluster.block_rank() == 0) {
    constexpr int kBatch = 16;  // the cluster is at most 16 CTAs: every split's loads in flight together
    for (int idx = threadIdx.x; idx < w.valid_heads * D / 4; idx += kThreads) {
      const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
      float2 st[kBatch];
      float4 x[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const bool in = j < w.num_splits;
        const unsigned rank = in ? static_cast<unsigned>(j) : 0u;
        const float* peer = cluster.map_shared_rank(P::acc(smem), rank);
        st[j] = in ? make_float2(peer[GT * D + g], peer[GT * D + GT + g]) : make_float2(-INFINITY, 0.f);
        x[j] = in ? *reinterpret_cast<const float4*>(peer + g * D + d) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float m = -INFINITY, l = 0.f;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      merge_batch(m, l, o, st, x);
      const int64_t row = static_cast<int64_t>(w.b) * p.num_heads + w.head0 + g;
      const float r = l > 0.f ? 1.f / l : 0.f;  // l == 0 only for an empty context: write zeros
      Elem<T>::store4(static_cast<T*>(p.out) + row * D + d, make_float4(o.x * r, o.y * r, o.z * r, o.w * r));
    }
  }
  if (kTraceBuild && p.trace != nullptr && cluster.block_rank() == 0) {
    __syncthreads();
    if (threadIdx.x == 0) trace_point(p, kTraceEnd), trace_flag(p, kTraceCombined);
  }
  cluster.sync();  // no CTA leaves (taking its shared memory along) before rank 0 has read it
  if (threadIdx.x == 0 && cluster.block_rank() != 0) trace_point(p, kTraceEnd);
#else
  (void)p, (void)smem, (void)w;
#endif
}

}  // namespace decode
}  // namespace hf_paged
