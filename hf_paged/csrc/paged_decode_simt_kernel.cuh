// The paged-decode kernel proper: main loop, CTA epilogue, and the last CTA's combine of the splits.
// Included from paged_decode.cuh, whose header comment describes the work split.
#pragma once

namespace hf_paged {
namespace decode {

constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

template <typename T, int D, int GT>
__device__ __forceinline__ void load_query(const DecodeParams& p, int b, int head0, int valid_heads, int sub,
                                           float (&q)[GT][Config<T, D, GT>::kDimsPerLane]) {
  using C = Config<T, D, GT>;
  const T* base = static_cast<const T*>(p.query) + b * p.q_stride_b;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
#pragma unroll
    for (int v = 0; v < C::kVecsPerLane; ++v) {
      float x[C::kVec];
      uint4 raw = make_uint4(0, 0, 0, 0);  // padding heads of a partial group score 0 and are never written
      if (g < valid_heads)
        raw = *reinterpret_cast<const uint4*>(base + (head0 + g) * p.q_stride_h + (sub + v * C::kLanesPerToken) * C::kVec);
      Elem<T>::unpack(raw, x);
#pragma unroll
      for (int e = 0; e < C::kVec; ++e) q[g][v * C::kVec + e] = x[e] * p.scale_log2;
    }
  }
}

// Merge the lane groups of a warp: lanes with the same `sub` hold the same dims, kLanesPerToken apart.
template <int GT, int DL, int LPT>
__device__ __forceinline__ void merge_warp(State<GT, DL>& st) {
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    float m = st.m[g];
#pragma unroll
    for (int off = LPT; off < 32; off *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float f = st.m[g] == -INFINITY ? 0.f : exp2f(st.m[g] - m);
    st.m[g] = m;
    st.l[g] *= f;
#pragma unroll
    for (int d = 0; d < DL; ++d) st.acc[g][d] *= f;
#pragma unroll
    for (int off = LPT; off < 32; off *= 2) {
      st.l[g] += __shfl_xor_sync(0xffffffffu, st.l[g], off);
#pragma unroll
      for (int d = 0; d < DL; ++d) st.acc[g][d] += __shfl_xor_sync(0xffffffffu, st.acc[g][d], off);
    }
  }
}

// Last CTA of a (sequence, head group): weight each split by exp2(m_s - M) and normalise by the total sum.
template <typename T, int D, int GT>
__device__ void combine_splits(const DecodeParams& p, unsigned char* smem, int b, int head0, int valid_heads,
                               int num_splits) {
  float* weight = reinterpret_cast<float*>(smem);  // [GT][kMaxSplits]
  float* inv_sum = weight + GT * kMaxSplits;       // [GT]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int g = warp; g < valid_heads; g += kWarps) {
    const float* stats = p.part_stats + (static_cast<int64_t>(b) * p.num_heads + head0 + g) * p.max_splits * 2;
    float m = -INFINITY;
    for (int s = lane; s < num_splits; s += 32) m = fmaxf(m, __ldcg(stats + 2 * s));
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
    for (int s = lane; s < num_splits; s += 32) {
      const float w = exp2f(__ldcg(stats + 2 * s) - m);
      weight[g * kMaxSplits + s] = w;
      l += w * __ldcg(stats + 2 * s + 1);
    }
    for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) inv_sum[g] = 1.f / l;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GT * D / 4; idx += kThreads) {
    const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
    if (g >= valid_heads) continue;
    const int64_t row = static_cast<int64_t>(b) * p.num_heads + head0 + g;
    const float4* src = reinterpret_cast<const float4*>(p.part_out + row * p.max_splits * D + d);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float4 x = __ldcg(src + s * (D / 4));
      const float w = weight[g * kMaxSplits + s];
      o.x = fmaf(w, x.x, o.x), o.y = fmaf(w, x.y, o.y), o.z = fmaf(w, x.z, o.z), o.w = fmaf(w, x.w, o.w);
    }
    const float r = inv_sum[g];
    Elem<T>::store4(static_cast<T*>(p.out) + row * D + d, make_float4(o.x * r, o.y * r, o.z * r, o.w * r));
  }
}

// Merge the warps' states through shared memory; write the final output (one split) or this split's partial.
template <typename T, int D, int GT>
__device__ __forceinline__ void write_cta_result(const DecodeParams& p, const State<GT, Config<T, D, GT>::kDimsPerLane>& st,
                                                 unsigned char* smem, int b, int head0, int valid_heads, int split,
                                                 int num_splits) {
  using C = Config<T, D, GT>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % C::kLanesPerToken;
  float* red_acc = reinterpret_cast<float*>(smem);  // [kWarps][GT][D]
  float* red_m = red_acc + kWarps * GT * D;          // [kWarps][GT]
  float* red_l = red_m + kWarps * GT;
  __syncthreads();  // every lane is done with its ring slots
  if (lane < C::kLanesPerToken) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int v = 0; v < C::kVecsPerLane; ++v)
#pragma unroll
        for (int e = 0; e < C::kVec; ++e)
          red_acc[(warp * GT + g) * D + (sub + v * C::kLanesPerToken) * C::kVec + e] = st.acc[g][v * C::kVec + e];
      if (sub == 0) red_m[warp * GT + g] = st.m[g], red_l[warp * GT + g] = st.l[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GT * D / 4; idx += kThreads) {
    const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
    if (g >= valid_heads) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red_m[w * GT + g]);
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = red_m[w * GT + g];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - m);
      const float4 a = *reinterpret_cast<const float4*>(red_acc + (w * GT + g) * D + d);
      l = fmaf(f, red_l[w * GT + g], l);
      o.x = fmaf(f, a.x, o.x), o.y = fmaf(f, a.y, o.y), o.z = fmaf(f, a.z, o.z), o.w = fmaf(f, a.w, o.w);
    }
    const int64_t row = static_cast<int64_t>(b) * p.num_heads + head0 + g;
    if (num_splits == 1) {
      const float r = l > 0.f ? 1.f / l : 0.f;  // l == 0 only for an empty context: write zeros
      Elem<T>::store4(static_cast<T*>(p.out) + row * D + d, make_float4(o.x * r, o.y * r, o.z * r, o.w * r));
    } else {
      const int64_t part = row * p.max_splits + split;
      *reinterpret_cast<float4*>(p.part_out + part * D + d) = o;
      if (d == 0) *reinterpret_cast<float2*>(p.part_stats + part * 2) = make_float2(m, l);
    }
  }
}

template <typename T, int D, int GT>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<T, D, GT>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  const int split = blockIdx.x, b = blockIdx.z;
  const int kvh = blockIdx.y / p.head_groups, hg = blockIdx.y - kvh * p.head_groups;
  const int head0 = kvh * p.group_size + hg * GT;
  const int valid_heads = cmin(GT, p.group_size - hg * GT);
  const int seq_len = cmin(p.seq_lens[b], p.max_context);
  // max_splits caps the count so that a max_seq_len below a real length cannot hang the ticket (it truncates).
  const int num_splits = cmin(cdiv(cmax(seq_len, 1), p.split_len), p.max_splits);
  if (split >= num_splits) return;
  const int t_begin = split * p.split_len, t_end = cmin(seq_len, t_begin + p.split_len);

  // The split's slice of the block table, so the copy loop's address math never waits on global memory.
  int* table = reinterpret_cast<int*>(smem + C::kSmemBytes);
  const int blk_first = block_of(t_begin, p);
  const int n_blocks = t_end > t_begin ? block_of(t_end - 1, p) - blk_first + 1 : 0;
  for (int i = threadIdx.x; i < n_blocks; i += kThreads)
    table[i] = p.block_tables[static_cast<int64_t>(b) * p.table_stride + blk_first + i];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % C::kLanesPerToken, group = warp * C::kGroupsPerWarp + lane / C::kLanesPerToken;
  float q[GT][C::kDimsPerLane];
  load_query<T, D, GT>(p, b, head0, valid_heads, sub, q);
  float slope[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g)
    slope[g] = (p.alibi_slopes != nullptr && g < valid_heads) ? p.alibi_slopes[head0 + g] * kLog2e : 0.f;
  State<GT, C::kDimsPerLane> st;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    st.m[g] = -INFINITY, st.l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < C::kDimsPerLane; ++d) st.acc[g][d] = 0.f;
  }
  __syncthreads();

  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + threadIdx.x * 16;
  const int n_iter = cdiv(t_end - t_begin, C::kTile);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter) issue_stage<T, D, GT>(p, ring, s, t_begin + s * C::kTile, t_end, blk_first, table, kvh, group, sub);
    cp_async_commit();
  }
  for (int it = 0; it < n_iter; ++it) {
    const int ahead = it + kStages - 1;
    if (ahead < n_iter)
      issue_stage<T, D, GT>(p, ring, ahead % kStages, t_begin + ahead * C::kTile, t_end, blk_first, table, kvh, group, sub);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this lane's copies for `it` have landed; its slots are private
    const int stage = it % kStages;
    float s[C::kUnroll][GT];
    stage_scores<T, D, GT>(smem, stage, q, s);
    bool valid[C::kUnroll];
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) {
      const int t = t_begin + it * C::kTile + u * C::kGroups + group;
      valid[u] = t < t_end;
#pragma unroll
      for (int g = 0; g < GT; ++g) s[u][g] = fmaf(slope[g], static_cast<float>(t - (seq_len - 1)), s[u][g]);
    }
    stage_accumulate<T, D, GT>(smem, stage, valid, s, st);
  }
  cp_async_wait<0>();
  merge_warp<GT, C::kDimsPerLane, C::kLanesPerToken>(st);
  write_cta_result<T, D, GT>(p, st, smem, b, head0, valid_heads, split, num_splits);
  if (num_splits == 1) return;

  __threadfence();  // publish this CTA's partial before taking a ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.counters + blockIdx.z * gridDim.y + blockIdx.y;
    is_last = atomicAdd(counter, 1) == num_splits - 1;
    if (is_last) *counter = 0;  // every other split has taken its ticket: reset for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  combine_splits<T, D, GT>(p, smem, b, head0, valid_heads, num_splits);
}

template <typename T, int D, int GT>
DecodeKernel make_entry() {
  using C = Config<T, D, GT>;
  DecodeKernel k;
  k.fn = reinterpret_cast<const void*>(&paged_decode_kernel<T, D, GT>);
  k.threads = kThreads;
  k.tile = C::kTile;
  k.min_split = C::kMinSplit;
  k.smem_bytes = C::kSmemBytes;
  return k;
}

template <typename T, int D>
DecodeKernel select_group_tile(int group_tile) {
  switch (group_tile) {
    case 1: return make_entry<T, D, 1>();
    case 2: return make_entry<T, D, 2>();
    case 4: return make_entry<T, D, 4>();
    case 8: return make_entry<T, D, 8>();
    default: return DecodeKernel{};
  }
}

template <typename T>
DecodeKernel select_kernel(int head_dim, int group_tile) {
  switch (head_dim) {
    case 64: return select_group_tile<T, 64>(group_tile);
    case 128: return select_group_tile<T, 128>(group_tile);
    case 256: return select_group_tile<T, 256>(group_tile);
    default: return DecodeKernel{};
  }
}

}  // namespace decode
}  // namespace hf_paged
