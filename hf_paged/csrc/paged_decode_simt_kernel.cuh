// The CUDA-core paged-decode kernel proper: query load, main loop, warp merge. Included from
// paged_decode_simt.cuh, whose header comment describes the work split.
#pragma once

namespace hf_paged {
namespace decode {

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
      if (g < valid_heads && C::in_row(sub, v))
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

// Lane group 0 of each warp leaves the warp's merged state in shared memory (the Reduce layout).
template <typename T, int D, int GT>
__device__ __forceinline__ void store_state(const State<GT, Config<T, D, GT>::kDimsPerLane>& st, unsigned char* smem) {
  using C = Config<T, D, GT>;
  using R = Reduce<D, GT>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % C::kLanesPerToken;
  __syncthreads();  // every lane is done with its ring slots
  if (lane < C::kLanesPerToken) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int v = 0; v < C::kVecsPerLane; ++v) {
        if (!C::in_row(sub, v)) continue;  // padding dims past D
        float* acc = R::acc(smem) + (warp * GT + g) * D + (sub + v * C::kLanesPerToken) * C::kVec;
#pragma unroll
        for (int e = 0; e < C::kVec; ++e) acc[e] = st.acc[g][v * C::kVec + e];
      }
      if (sub == 0) R::m(smem)[warp * GT + g] = st.m[g], R::l(smem)[warp * GT + g] = st.l[g];
    }
  }
  __syncthreads();
}

template <typename T, int D, int GT>
__global__ void __launch_bounds__(kThreads) paged_decode_simt_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<T, D, GT>;
  extern __shared__ __align__(16) unsigned char smem[];
  int* table = reinterpret_cast<int*>(smem + C::kSmemBytes);
  CtaWork w;
  if (!cta_work</*kPrefillRows=*/true>(p, GT, table, w)) return;
  wait_for_prior_grid();  // everything below may read what the previous kernel wrote (decode with PDL)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % C::kLanesPerToken, group = warp * C::kGroupsPerWarp + lane / C::kLanesPerToken;
  float q[GT][C::kDimsPerLane];
  load_query<T, D, GT>(p, w.b, w.head0, w.valid_heads, sub, q);
  State<GT, C::kDimsPerLane> st;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    st.m[g] = -INFINITY, st.l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < C::kDimsPerLane; ++d) st.acc[g][d] = 0.f;
  }

  // q carries scale * log2(e), so the scores do too: the cap in the same units.
  const float cap = p.softcap * p.scale_log2, inv_cap = p.softcap_inv / p.scale_log2;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + threadIdx.x * 16;
  const int n_iter = cdiv(w.t_end - w.t_begin, C::kTile);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter)
      issue_stage<T, D, GT>(p, ring, s, w.t_begin + s * C::kTile, w.t_end, w.blk_first, table, w.kvh, group, sub);
    cp_async_commit();
  }
  for (int it = 0; it < n_iter; ++it) {
    const int ahead = it + kStages - 1;
    if (ahead < n_iter)
      issue_stage<T, D, GT>(p, ring, ahead % kStages, w.t_begin + ahead * C::kTile, w.t_end, w.blk_first, table,
                            w.kvh, group, sub);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this lane's copies for `it` have landed; its slots are private
    const int stage = it % kStages;
    float s[C::kUnroll][GT];
    stage_scores<T, D, GT>(smem, stage, q, cap, inv_cap, s);
    bool valid[C::kUnroll];
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) valid[u] = w.t_begin + it * C::kTile + u * C::kGroups + group < w.t_end;
    stage_accumulate<T, D, GT>(smem, stage, valid, s, st);
  }
  cp_async_wait<0>();
  if (threadIdx.x == 0) trace_point(p, kTraceLoopDone);  // (no first-tile point in this kernel)
  let_dependents_launch();
  merge_warp<GT, C::kDimsPerLane, C::kLanesPerToken>(st);
  store_state<T, D, GT>(st, smem);
  finish_cta<T, D, GT>(p, smem, w);
}

template <typename T, int D, int GT>
DecodeKernel make_entry() {
  using C = Config<T, D, GT>;
  DecodeKernel k;
  k.fn = reinterpret_cast<const void*>(&paged_decode_simt_kernel<T, D, GT>);
  k.threads = kThreads;
  k.tile = C::kTile;
  k.min_split = C::kMinSplit;
  k.smem_bytes = C::kSmemBytes;
  k.heads_per_cta = GT;
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

// Up to 8 query heads per CTA (registers hold q and the accumulator of each); larger groups use several CTAs.
template <typename T>
DecodeKernel select_simt_kernel(int head_dim, int group_size) {
  const int gt = group_size <= 1 ? 1 : group_size <= 2 ? 2 : group_size <= 4 ? 4 : 8;
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 32: return select_group_tile<T, 32>(gt);
    case 64: return select_group_tile<T, 64>(gt);
    case 80: return select_group_tile<T, 80>(gt);
    case 96: return select_group_tile<T, 96>(gt);
    case 112: return select_group_tile<T, 112>(gt);
    case 128: return select_group_tile<T, 128>(gt);
    case 160: return select_group_tile<T, 160>(gt);
    case 192: return select_group_tile<T, 192>(gt);
    case 256: return select_group_tile<T, 256>(gt);
    default: return DecodeKernel{};
  }
}

}  // namespace decode
}  // namespace hf_paged
