// The tensor-core paged-decode kernel: one warp step over a 16-token tile, the kernel, and its entry points.
// paged_decode_mma.cuh describes the work split.
#pragma once

#include "paged_decode_mma_fp8.cuh"

namespace hf_paged {
namespace decode {

// S = Q K^T for the tile (softcapped when asked), scaled to log2 units, tokens past the split masked.
template <typename T, typename KV, int D>
__device__ __forceinline__ void tile_scores(const CtaScale& sc, const CtaWork& w, uint32_t k_tile, int t0, int lane,
                                           const uint32_t (&qa)[D / 16][4], float (&s)[2][4]) {
  if constexpr (sizeof(KV) == 1) {
    fp8_tile_qk<T, D>(k_tile, lane, qa, s);
  } else {
    // ldmatrix x4 matrices: (tokens 0-7, dims lo), (0-7, hi), (8-15, lo), (8-15, hi) = B fragments of two n-tiles.
    const int mat = lane >> 3, row = (lane & 7) + (mat >> 1) * 8, half = mat & 1;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[4];
      ldmatrix_x4(b, swizzled<D>(k_tile, row, 2 * ks + half));
      Mma<T>::run(s[0], qa[ks], b[0], b[1]);
      Mma<T>::run(s[1], qa[ks], b[2], b[3]);
    }
  }
  if (sc.softcap > 0.f) {
    const float exp_scale = softcap_exp_scale(sc.softcap_inv);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = softcapped(s[j][e], sc.softcap, exp_scale);
  }
  const int t_lane = t0 + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = t_lane + j * 8 + (e & 1);
      s[j][e] = t < w.t_end ? s[j][e] * sc.scale_log2 : -INFINITY;
    }
}

// Online softmax over the tile's scores, then O += P V.
template <typename T, typename KV, int D>
__device__ __forceinline__ void tile_accumulate(uint32_t v_tile, int lane, float (&s)[2][4], MmaState<D>& st) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (mx > st.m[r] + kMmaRescaleThreshold) {  // the quad agrees: same mx, same m
      const float alpha = exp2f(st.m[r] - mx);  // 0 on the first tile (m = -inf)
      st.l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) st.o[n][2 * r] *= alpha, st.o[n][2 * r + 1] *= alpha;
      st.m[r] = mx;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[j][e] = exp2f(s[j][e] - st.m[r]);  // masked: exp2(-inf) = 0; every tile has a valid token, so m > -inf
        st.l[r] += s[j][e];
      }
  }
  // The S accumulators of n-tiles 0 and 1 are exactly the A fragment of one 16-token k-step.
  const uint32_t pa[4] = {Mma<T>::pack(s[0][0], s[0][1]), Mma<T>::pack(s[0][2], s[0][3]),
                          Mma<T>::pack(s[1][0], s[1][1]), Mma<T>::pack(s[1][2], s[1][3])};
  if constexpr (sizeof(KV) == 1) {
    fp8_tile_pv<T, D>(v_tile, lane, pa, st.o);
  } else {
    // ldmatrix x4 trans matrices: (tokens 0-7, dims lo), (8-15, lo), (0-7, hi), (8-15, hi) = two n-tiles of V.
    const int mat = lane >> 3, row = (lane & 7) + (mat & 1) * 8, half = mat >> 1;
#pragma unroll
    for (int nd = 0; nd < D / 16; ++nd) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, swizzled<D>(v_tile, row, 2 * nd + half));
      Mma<T>::run(st.o[2 * nd], pa, b[0], b[1]);
      Mma<T>::run(st.o[2 * nd + 1], pa, b[2], b[3]);
    }
  }
}

// Sum l over the quad and leave this warp's rows in shared memory (the Reduce layout), times the CTA's V scale,
// with an e4m3 cache's output columns put back in dim order (fp8_out_dim).
template <int D, bool kFp8>
__device__ __forceinline__ void store_mma_state(MmaState<D>& st, unsigned char* smem, const CtaWork& w, int lane,
                                                int warp, float v_scale) {
  using R = Reduce<D, MmaConfig<D>::kRows>;
  constexpr int kRows = MmaConfig<D>::kRows;
  __syncthreads();  // the Reduce area overlaps other warps' rings
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    const int g = (lane >> 2) + 8 * r;
    if (g >= w.valid_heads) continue;
    float* acc = R::acc(smem) + (warp * kRows + g) * D;
    const int col = 2 * (lane & 3);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      if constexpr (kFp8) {
        acc[fp8_out_dim(n, col)] = st.o[n][2 * r] * v_scale;
        acc[fp8_out_dim(n, col + 1)] = st.o[n][2 * r + 1] * v_scale;
      } else {
        *reinterpret_cast<float2*>(acc + n * 8 + col) = make_float2(st.o[n][2 * r], st.o[n][2 * r + 1]);
      }
    }
    if ((lane & 3) == 0) R::m(smem)[warp * kRows + g] = st.m[r], R::l(smem)[warp * kRows + g] = st.l[r];
  }
  __syncthreads();
}

// KV: the cache's element type, T (the query's) or E4M3.
template <typename T, typename KV, int D>
__global__ void __launch_bounds__(kThreads) paged_decode_mma_kernel(const __grid_constant__ DecodeParams p) {
  using C = MmaConfig<D, sizeof(KV)>;
  constexpr bool kFp8 = sizeof(KV) == 1;
  extern __shared__ __align__(128) unsigned char smem[];
  int* table = reinterpret_cast<int*>(smem + C::kSmemBytes);
  CtaWork w;
  if (!cta_work(p, C::kRows, table, w)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // This warp's tiles: warp, warp + 4, ... of the split's 16-token tiles.
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * C::kWarpRingBytes;
  const int n_tiles = cdiv(w.t_end - w.t_begin, C::kTokens);
  const int my_tiles = n_tiles > warp ? cdiv(n_tiles - warp, kWarps) : 0;
  const int t_first = w.t_begin + warp * C::kTokens, t_step = kWarps * C::kTokens;
  // The ring's first tiles that end before the sequence's newest key are copied before waiting for the previous
  // kernel (wait_for_prior_grid: under programmatic dependent launch, their DRAM latency then overlaps that kernel's
  // tail), the others after it. A prefix of the stages, so the copy groups stay in stage order.
  // Without programmatic dependent launch, the query and scales are asked for first (a short split waits on them).
  int early = 0;
  if (p.pdl_lead >= 0) {
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s)
      if (s == early && s < my_tiles && t_first + s * t_step + C::kTokens <= w.seq_len - 1) ++early;
  }
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < early) {
      issue_tile<KV, D>(p, ring + s * 2 * C::kTileBytes, t_first + s * t_step, w, table, lane);
      cp_async_commit();
    }
  }
  wait_for_prior_grid();  // everything below may read what the previous kernel wrote
  const CtaScale sc = cta_scale<kFp8>(p, w.kvh);

  uint32_t qa[D / 16][4];
  load_q_fragments<T, D, kFp8>(p, w, lane, qa);
  MmaState<D> st;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.f;
  st.m[0] = st.m[1] = -INFINITY, st.l[0] = st.l[1] = 0.f;
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s >= early) {
      if (s < my_tiles) issue_tile<KV, D>(p, ring + s * 2 * C::kTileBytes, t_first + s * t_step, w, table, lane);
      cp_async_commit();
    }
  }
  for (int it = 0; it < my_tiles; ++it) {
    const int ahead = it + C::kStages - 1;
    if (ahead < my_tiles)
      issue_tile<KV, D>(p, ring + (ahead % C::kStages) * 2 * C::kTileBytes, t_first + ahead * t_step, w, table, lane);
    cp_async_commit();
    cp_async_wait<C::kStages - 1>();
    __syncwarp();  // every lane's copies of tile `it` are visible to the whole warp
    if (kTraceBuild && it == 0 && threadIdx.x == 0) trace_point(p, kTraceFirstTile);
    const uint32_t k_tile = ring + (it % C::kStages) * 2 * C::kTileBytes;
    float s[2][4];
    tile_scores<T, KV, D>(sc, w, k_tile, t_first + it * t_step, lane, qa, s);
    tile_accumulate<T, KV, D>(k_tile + C::kTileBytes, lane, s, st);
    __syncwarp();  // the whole warp is done reading this stage before it is refilled
    if (it + 1 + p.pdl_lead == my_tiles) let_dependents_launch();
  }
  cp_async_wait<0>();
  if (threadIdx.x == 0) trace_point(p, kTraceLoopDone);
  let_dependents_launch();  // (a warp with pdl_lead or fewer tiles; repeats are no-ops)
  store_mma_state<D, kFp8>(st, smem, w, lane, warp, sc.v_scale);
  finish_cta<T, D, C::kRows>(p, smem, w);
}

template <typename T, typename KV, int D>
DecodeKernel make_mma_entry() {
  using C = MmaConfig<D, sizeof(KV)>;
  DecodeKernel k;
  k.fn = reinterpret_cast<const void*>(&paged_decode_mma_kernel<T, KV, D>);
  k.threads = kThreads;
  k.tile = C::kCtaTile;
  k.min_split = C::kMinSplit;
  k.smem_bytes = C::kSmemBytes;
  k.heads_per_cta = C::kRows;
  return k;
}

template <typename T>
DecodeKernel select_mma_kernel(int head_dim) {
  switch (head_dim) {  // keep in step with hf_paged/kernels/__init__.py's HEAD_DIMS
    case 32: return make_mma_entry<T, T, 32>();
    case 64: return make_mma_entry<T, T, 64>();
    case 80: return make_mma_entry<T, T, 80>();
    case 96: return make_mma_entry<T, T, 96>();
    case 112: return make_mma_entry<T, T, 112>();
    case 128: return make_mma_entry<T, T, 128>();
    case 160: return make_mma_entry<T, T, 160>();
    case 192: return make_mma_entry<T, T, 192>();
    case 256: return make_mma_entry<T, T, 256>();
    default: return DecodeKernel{};
  }
}

// The e4m3-cache kernels (T: the query's dtype, fp16 or bf16); keep in step with hf_paged/kernels/__init__.py's
// FP8_HEAD_DIMS.
template <typename T>
DecodeKernel select_mma_e4m3_kernel(int head_dim) {
  switch (head_dim) {
    case 64: return make_mma_entry<T, E4M3, 64>();
    case 128: return make_mma_entry<T, E4M3, 128>();
    case 256: return make_mma_entry<T, E4M3, 256>();
    default: return DecodeKernel{};
  }
}

}  // namespace decode
}  // namespace hf_paged
