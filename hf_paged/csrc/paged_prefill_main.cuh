// The prefill kernel's body: online softmax, the pipelined main loop and the epilogue.
// Included from paged_prefill_kernel.cuh (tile helpers there).
#pragma once

namespace hf_paged {
namespace prefill {

// Per thread: the rows g and g + 8 of each of the warp's atoms (index [mi][half]).
template <class C>
struct RowState {
  float m[C::kMAtoms][2];  // running max of the raw scores (times scale_log2: base-2 units)
  float l[C::kMAtoms][2];  // this thread's share of the running sum (reduced over the quad at the end)
};

// Logit softcapping of one tile of raw scores (cap in units of q.k, see PrefillParams).
template <class C>
__device__ __forceinline__ void softcap_tile(float (&s)[C::kMAtoms][C::kBlockN / 8][4], float cap, float exp_scale) {
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi)
#pragma unroll
    for (int nt = 0; nt < C::kBlockN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nt][e] = softcapped(s[mi][nt][e], cap, exp_scale);
}

// Scale (and mask) one tile of scores, fold it into the running max / sum and leave exp2(score - max) in s; corrs
// gets the factor O must be scaled by, needed when the result is true (some row of the warp moved its max).
// q_pos0 = absolute position of this thread's row g of atom 0; key0 = tile's first key.
// kMask: keys past a row's position and keys at or before its position - window are masked.
template <class C, bool kMask>
__device__ __forceinline__ bool softmax_scores(float (&s)[C::kMAtoms][C::kBlockN / 8][4], RowState<C>& st,
                                               float scale_log2, int q_pos0, int window, int key0, int lane,
                                               float (&corrs)[C::kMAtoms][2]) {
  const int t = lane & 3;
  bool moved = false;
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int q_pos = q_pos0 + mi * 16 + half * 8;
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < C::kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[mi][nt][2 * half + e];
          const int key = key0 + nt * 8 + 2 * t + e;
          if (kMask && (key > q_pos || key <= q_pos - window)) x = -INFINITY;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The max is taken over raw scores; the scale is folded into the exponent (one FFMA per score).
      const float m_new = fmaxf(st.m[mi][half], mx);
      // A row that has seen only masked keys keeps max -inf: subtract 0 instead, so exp2 gives 0, not NaN.
      const float base = m_new == -INFINITY ? 0.f : m_new * scale_log2;
      const float corr = fast_exp2(st.m[mi][half] * scale_log2 - base);
      corrs[mi][half] = corr;
      moved |= m_new != st.m[mi][half];
      st.m[mi][half] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < C::kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[mi][nt][2 * half + e];
          x = fast_exp2(x * scale_log2 - base);
          sum += x;
        }
      }
      st.l[mi][half] = st.l[mi][half] * corr + sum;
    }
  }
  // Once the running maxima settle (most tiles of a long row), no row of the warp moves and O needs no rescale.
  return __any_sync(0xffffffffu, moved);
}

template <class C>
__device__ __forceinline__ void rescale_o(float (&o)[C::kMAtoms][C::D / 8][4], const float (&corrs)[C::kMAtoms][2]) {
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int dt = 0; dt < C::D / 8; ++dt)
        o[mi][dt][2 * half] *= corrs[mi][half], o[mi][dt][2 * half + 1] *= corrs[mi][half];
}

// softmax_scores, then O's rescale when needed.
template <class C, bool kMask>
__device__ __forceinline__ void softmax_tile(float (&s)[C::kMAtoms][C::kBlockN / 8][4],
                                             float (&o)[C::kMAtoms][C::D / 8][4], RowState<C>& st, float scale_log2,
                                             int q_pos0, int window, int key0, int lane) {
  float corrs[C::kMAtoms][2];
  if (softmax_scores<C, kMask>(s, st, scale_log2, q_pos0, window, key0, lane, corrs)) rescale_o<C>(o, corrs);
}

// Normalise O (times out_scale), stage the warp's rows in its own (no longer needed) slice of the Q tile, then write 16-byte chunks.
template <class C>
__device__ __forceinline__ void store_output(const PrefillParams& p, float (&o)[C::kMAtoms][C::D / 8][4],
                                             RowState<C>& st, typename C::T* q_tile, int warp_row0, int lane,
                                             int m0, int q_len, int q_start, int head, float out_scale) {
  using T = typename C::T;
  const int g = lane >> 2, t = lane & 3;
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = st.l[mi][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = (l > 0.f ? 1.f / l : 0.f) * out_scale;  // an e4m3 cache's V scale, else 1
      const int row = warp_row0 + mi * 16 + half * 8 + g;
#pragma unroll
      for (int dt = 0; dt < C::D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(q_tile + swizzle<C::D>(row, dt) + 2 * t) =
            Mma<T>::pack(o[mi][dt][2 * half] * inv, o[mi][dt][2 * half + 1] * inv);
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < C::kWarpRows * C::kChunks / 32; ++i) {
    const int idx = lane + 32 * i, r = idx / C::kChunks, c = idx % C::kChunks;
    const int q_row = m0 + warp_row0 + r;
    if (q_row < q_len) {
      T* dst = static_cast<T*>(p.out) + (q_start + q_row) * p.o_stride_t + head * p.o_stride_h + c * 8;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(q_tile + swizzle<C::D>(warp_row0 + r, c));
    }
  }
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1) paged_prefill_kernel(const PrefillParams p) {
  using T = typename C::T;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  const uint32_t q_smem = smem_u32(q_tile);
  // 16-bit K stages, then V stages (two each; one each for an e4m3 cache, whose byte stages follow: kRawOffset)
  const uint32_t k_smem = q_smem + C::kBlockM * C::kPitch * sizeof(T);
  const uint32_t v_smem = k_smem + C::kStages16 * C::kTile * sizeof(T);
  const uint32_t raw_smem = q_smem + C::kRawOffset;  // e4m3: stage s holds K at 2s, V at 2s + 1 (kRawTile bytes)

  const int b = blockIdx.z, head = blockIdx.y;
  const int q_start = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * C::kBlockM;  // heaviest query tiles first
  if (m0 >= q_len) return;
  const int k_len = min(p.seq_lens_k[b], p.max_context);
  const int prefix = max(k_len - q_len, 0);
  const int n_end = min(k_len, prefix + m0 + C::kBlockM);  // keys the tile's last row may see
  const int n_tiles = (n_end + C::kBlockN - 1) / C::kBlockN;
  // Sliding window: row i sees keys from i - window + 1 on. Tiles before the first row's window are skipped, tiles
  // that start before the last row's window are masked (none of either without a window: kNoWindow is INT32_MAX).
  const int n_first = max(prefix + m0 - p.window + 1, 0) / C::kBlockN;
  const int last_pos = prefix + min(m0 + C::kBlockM, q_len) - 1;
  const int window_masked_end = last_pos >= p.window ? (last_pos - p.window) / C::kBlockN + 1 : 0;
  const int kv_head = head / p.group_size;
  const CtaScale sc = cta_scale<C>(p, kv_head);
  const int* table = p.block_tables + static_cast<int64_t>(b) * p.table_stride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int fixed_col = C::kFixedChunk ? tid % C::kChunks * 8 : 0;  // this thread's column when it keeps one
  const int64_t head_off = static_cast<int64_t>(kv_head) * C::D + fixed_col;
  // Tile n is staged in half (stage) n & 1 of the slots and of the K/V stages.
  int* slots = reinterpret_cast<int*>(smem_raw + C::kSlotsOffset);  // [2][kBlockN]
  // Tile n's copies into stage n & 1: 16-bit tiles, or the e4m3 bytes (16 per chunk: their own column).
  auto issue_tile = [&](int stage) {
    if constexpr (C::kFp8) {
      const int64_t kv_off = static_cast<int64_t>(kv_head) * C::D + tid % (C::D / 16) * 16;
      issue_kv_tile_e4m3<C>(p, kv_off, slots + stage * C::kBlockN, raw_smem + 2 * stage * C::kRawTile,
                            raw_smem + (2 * stage + 1) * C::kRawTile, tid);
    } else {
      issue_kv_tile<C>(p, head_off, slots + stage * C::kBlockN, k_smem + stage * C::kTile * sizeof(T),
                       v_smem + stage * C::kTile * sizeof(T), tid);
    }
  };

  // Q tile (rows past the sequence zero-filled) as its own commit group, then K/V tile 0.
  {
    const T* q = static_cast<const T*>(p.query) + head * p.q_stride_h + fixed_col;
#pragma unroll
    for (int i = 0; i < C::kQCopies; ++i) {
      int r, chunk;
      if (!copy_slot<C, C::kBlockM>(tid, i, r, chunk)) break;
      const bool valid = m0 + r < q_len;
      const T* src = q + (C::kFixedChunk ? 0 : chunk * 8) + (valid ? (q_start + m0 + r) * p.q_stride_t : 0);
      cp_async16(swizzled<C::D>(q_smem, r, chunk), src, valid);
    }
    cp_async_commit();
  }
  // Slots of tiles n_first and n_first + 1; thread r < BLOCK_N then keeps the block id of its row two tiles ahead.
  const bool slot_thread = tid < C::kBlockN;
  const int first_stage = n_first & 1;
  int next_blk = -1;
  if (slot_thread) {
    const int tok = n_first * C::kBlockN + tid;
    slots[first_stage * C::kBlockN + tid] = slot_of(p, tok, block_of(p, table, tok, n_end));
    slots[(first_stage ^ 1) * C::kBlockN + tid] = slot_of(p, tok + C::kBlockN, block_of(p, table, tok + C::kBlockN,
                                                                                         n_end));
    next_blk = block_of(p, table, tok + 2 * C::kBlockN, n_end);
  }
  __syncthreads();
  issue_tile(first_stage);
  cp_async_commit();

  const int warp_row0 = warp * C::kWarpRows;
  uint32_t qf[C::kQInRegs ? C::kMAtoms : 1][C::D / 16][4];
  if constexpr (C::kQInRegs) {
    cp_async_wait<1>();
    __syncthreads();
    const int q_row = warp_row0 + (lane & 7) + (((lane >> 3) & 1) << 3), q_chunk = lane >> 4;
#pragma unroll
    for (int mi = 0; mi < C::kMAtoms; ++mi)
#pragma unroll
      for (int kk = 0; kk < C::D / 16; ++kk)
        ldmatrix_x4(qf[mi][kk], swizzled<C::D>(q_smem, q_row + mi * 16, 2 * kk + q_chunk));
  }

  float o[C::kMAtoms][C::D / 8][4];
  RowState<C> st;
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi) {
#pragma unroll
    for (int dt = 0; dt < C::D / 8; ++dt) o[mi][dt][0] = o[mi][dt][1] = o[mi][dt][2] = o[mi][dt][3] = 0.f;
    st.m[mi][0] = st.m[mi][1] = -INFINITY;
    st.l[mi][0] = st.l[mi][1] = 0.f;
  }
  const int q_pos0 = prefix + m0 + warp_row0 + (lane >> 2);  // absolute position of this thread's first row
  // Tiles from here on hold keys past the first row of the CTA's diagonal.
  const int first_masked = (prefix + m0 + 1) / C::kBlockN;

  for (int n = n_first; n < n_tiles; ++n) {
    const int stage = n & 1;
    if (n + 1 < n_tiles) issue_tile(stage ^ 1);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning "tile n"
    cp_async_wait<1>();
    __syncthreads();
    // Tile n's slots were used when it was issued; this half now takes tile n + 2's.
    auto next_slots = [&] {
      if (slot_thread) {
        const int tok = (n + 2) * C::kBlockN + tid;
        slots[stage * C::kBlockN + tid] = slot_of(p, tok, next_blk);
        next_blk = block_of(p, table, tok + C::kBlockN, n_end);
      }
    };
    if constexpr (C::kFp8) {  // widen tile n into the 16-bit tiles (the MMAs of tile n - 1 are behind the barrier)
      const unsigned char* raw = smem_raw + C::kRawOffset + 2 * stage * C::kRawTile;
      widen_tile<C>(raw, q_tile + C::kBlockM * C::kPitch, tid);
      widen_tile<C>(raw + C::kRawTile, q_tile + C::kBlockM * C::kPitch + C::kTile, tid);
      next_slots();
      __syncthreads();  // the next iteration's copies refill this byte stage (and read the slots just written)
    }
    const int stage16 = C::kFp8 ? 0 : stage;

    float s[C::kMAtoms][C::kBlockN / 8][4];
    qk_tile<C>(s, qf, q_smem, k_smem + stage16 * C::kTile * sizeof(T), warp_row0, lane);
    if (sc.softcap > 0.f) softcap_tile<C>(s, sc.softcap, softcap_exp_scale(sc.softcap_inv));
    if (n >= first_masked || n < window_masked_end)
      softmax_tile<C, true>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    else
      softmax_tile<C, false>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    pv_tile<C>(o, s, v_smem + stage16 * C::kTile * sizeof(T), lane);
    if constexpr (!C::kFp8) {
      next_slots();
      __syncthreads();  // the next iteration refills this stage (and reads the slots just written)
    }
  }
  store_output<C>(p, o, st, q_tile, warp_row0, lane, m0, q_len, q_start, head, sc.out_scale);
}

// The kernel and its launch constants for one configuration index (see paged_prefill.cuh). Config 0 (32 rows per
// warp) only up to head_dim 128: beyond, O and S exceed the register file.
template <typename T, typename KV, int D>
PrefillKernel kernel_for_config(int config) {
  auto make = [](auto traits) {
    using C = decltype(traits);
    return PrefillKernel{reinterpret_cast<const void*>(&paged_prefill_kernel<C>), C::kThreads, C::kBlockM,
                         C::kSmemBytes};
  };
  switch (config) {
    case 0:
      if constexpr (D <= 128) return make(Traits<T, D, 4, 2, KV>{});
      return PrefillKernel{};
    case 1: return make(Traits<T, D, 4, 1, KV>{});
    case 2: return make(Traits<T, D, 8, 1, KV>{});
    default: return PrefillKernel{};
  }
}

// The kernel for (head_dim, config) among head sizes Ds (one translation unit's share) over a cache of KV elements;
// fn == nullptr otherwise.
template <typename T, typename KV, int... Ds>
PrefillKernel select_head_dim(int head_dim, int config) {
  PrefillKernel k{};
  ((head_dim == Ds ? (void)(k = kernel_for_config<T, KV, Ds>(config)) : (void)0), ...);
  return k;
}

}  // namespace prefill
}  // namespace hf_paged
