// Paged varlen prefill on tensor cores (FA2-style): one CTA owns BLOCK_M query rows of one (sequence, head) and
// walks that sequence's K/V in BLOCK_N-token tiles read through the block table.
//
// - Each warp owns kMAtoms * 16 query rows; S = Q K^T and O += P V are mma.sync m16n8k16 with fp32 accumulators,
//   the softmax is online (running max and sum per row, in base 2) and P stays in registers (see ptx.cuh).
// - K/V tiles are staged in shared memory by cp.async, two stages deep: tile n+1 is in flight while tile n is used.
//   A tile's rows may come from several cache blocks (block_size 16 < BLOCK_N), so every row finds its own slot:
//   one thread per row looks its block up two tiles ahead and leaves the slot in shared memory, so the lookup
//   latency hides behind the MMAs and the copying threads keep no per-row registers across the loop.
// - Causal masking is only evaluated on the tiles that cross the diagonal; query tiles are scheduled heaviest
//   (latest rows, longest context) first so that the grid's tail is made of short CTAs.
// - A sliding window skips the tiles before the CTA's first row's window and masks the tiles that cross its lower
//   edge; logit softcapping rewrites a tile's raw scores before the softmax. Both are launch arguments (one branch
//   per tile), not compiled variants.
#pragma once

#include "fp8.cuh"
#include "paged_prefill.cuh"
#include "ptx.cuh"

namespace hf_paged {
namespace prefill {

// KV_: the cache's element type, T_ (the query's) or E4M3 (see paged_prefill_fp8.cuh).
template <typename T_, int D_, int kWarps_, int kMAtoms_, typename KV_ = T_>
struct Traits {
  using T = T_;
  using KV = KV_;
  static constexpr bool kFp8 = sizeof(KV) == 1;
  static constexpr int D = D_, kWarps = kWarps_, kMAtoms = kMAtoms_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 64;
  static constexpr int kWarpRows = kMAtoms * 16;
  static constexpr int kBlockM = kWarps * kWarpRows;
  static constexpr int kChunks = D / 8;                              // 16-byte chunks per row
  static constexpr int kPitch = tile_pitch<D>();                     // row stride of the shared-memory tiles
  // Copies: a tile's rows laid end to end, thread `tid` takes chunks tid, tid + kThreads, ... (see copy_slot).
  static constexpr bool kFixedChunk = kThreads % kChunks == 0;      // a thread keeps one chunk column
  static constexpr int kKVCopies = (kBlockN * kChunks + kThreads - 1) / kThreads;  // per K (and V) tile
  static constexpr int kQCopies = (kBlockM * kChunks + kThreads - 1) / kThreads;
  // Q fragments stay in registers when they are small; otherwise they are re-read from shared memory per tile.
  static constexpr bool kQInRegs = kMAtoms * D <= 128;
  static constexpr int kTile = kBlockN * kPitch;                     // elements of one K or V stage
  // 16-bit K/V tiles the MMAs read: two stages each, or one each for an e4m3 cache, whose two stages of K and V
  // arrive as bytes (kRawTile each, rows of D bytes end to end) behind them and are widened into the one stage.
  static constexpr int kStages16 = kFp8 ? 1 : 2;
  static constexpr int kRawTile = kFp8 ? kBlockN * D : 0;
  static constexpr int kRawOffset = (kBlockM * kPitch + 2 * kStages16 * kTile) * static_cast<int>(sizeof(T));
  static constexpr int kSlotsOffset = kRawOffset + 4 * kRawTile;
  static constexpr int kSmemBytes = kSlotsOffset + 2 * kBlockN * static_cast<int>(sizeof(int));  // + slots[2][N]
  // O takes kMAtoms * D / 2 registers per thread and S kMAtoms * 32: two m atoms per warp fit up to D = 128 only.
  static_assert(kMAtoms == 1 || D <= 128, "32 rows per warp would spill at this head size");
  static_assert(!kFp8 || (D % 64 == 0 && kThreads % kChunks == 0), "e4m3 tiles: swizzled rows, fixed columns");
  // Byte offset of (row, 16-byte chunk) in a 16-bit K/V stage (issue_kv_tile; the wgmma kernel lays tiles out its way).
  __device__ __forceinline__ static uint32_t kv_offset(int row, int chunk) {
    return static_cast<uint32_t>(swizzle<D>(row, chunk) * sizeof(T));
  }
};

// Row and chunk of this thread's i-th 16-byte copy into a tile of `kRows` rows; false past the tile (only when the
// tile's chunk count is not a multiple of the thread count). When kThreads is a multiple of kChunks (head sizes
// 32, 64, 128, 256) a thread keeps one chunk column and steps kThreads / kChunks rows.
template <class C, int kRows>
__device__ __forceinline__ bool copy_slot(int tid, int i, int& row, int& chunk) {
  if constexpr (C::kFixedChunk) {
    row = tid / C::kChunks + i * (C::kThreads / C::kChunks), chunk = tid % C::kChunks;
  } else {
    const int idx = tid + i * C::kThreads;
    row = idx / C::kChunks, chunk = idx % C::kChunks;
  }
  return (kRows * C::kChunks) % C::kThreads == 0 || tid + i * C::kThreads < kRows * C::kChunks;
}

// Copies this thread's chunks of one K/V tile. slots[r] is the cache slot (block * block_size + offset) of row r,
// or -1 for rows past what this CTA needs (zero-filled). head_off = kv_head * D, plus the thread's chunk * 8 when
// it keeps one chunk column (kFixedChunk).
template <class C>
__device__ __forceinline__ void issue_kv_tile(const PrefillParams& p, int64_t head_off, const int* slots,
                                              uint32_t k_dst, uint32_t v_dst, int tid) {
  using T = typename C::T;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * C::D;
#pragma unroll
  for (int i = 0; i < C::kKVCopies; ++i) {
    int row, chunk;
    if (!copy_slot<C, C::kBlockN>(tid, i, row, chunk)) break;
    const int slot = slots[row];
    const bool valid = slot >= 0;
    const int64_t off = valid ? slot * row_stride + head_off + (C::kFixedChunk ? 0 : chunk * 8) : 0;
    const uint32_t dst = C::kv_offset(row, chunk);
    cp_async16(k_dst + dst, static_cast<const T*>(p.k_cache) + off, valid);
    cp_async16(v_dst + dst, static_cast<const T*>(p.v_cache) + off, valid);
  }
}

// Block id of token `tok` (or -1 from n_end on: nothing past it is needed); a plain load, used a tile later.
__device__ __forceinline__ int block_of(const PrefillParams& p, const int* table, int tok, int n_end) {
  if (tok >= n_end) return -1;
  return __ldg(table + (p.block_shift >= 0 ? tok >> p.block_shift : tok / p.block_size));
}

__device__ __forceinline__ int slot_of(const PrefillParams& p, int tok, int blk) {
  const int off = p.block_shift >= 0 ? tok & (p.block_size - 1) : tok % p.block_size;
  return blk < 0 ? -1 : blk * p.block_size + off;
}

// S = Q K^T for this warp's rows over one tile: s[mi][nt] is the 16x8 C fragment of atom mi, key columns 8nt..
template <class C>
__device__ __forceinline__ void qk_tile(float (&s)[C::kMAtoms][C::kBlockN / 8][4],
                                        const uint32_t (&qf)[C::kQInRegs ? C::kMAtoms : 1][C::D / 16][4],
                                        uint32_t q_smem, uint32_t k_smem, int warp_row0, int lane) {
  using T = typename C::T;
#pragma unroll
  for (int mi = 0; mi < C::kMAtoms; ++mi)
#pragma unroll
    for (int nt = 0; nt < C::kBlockN / 8; ++nt) s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0.f;
  // ldmatrix.x4 on K: matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
  // give b0/b1 of two adjacent key tiles; lane l addresses row l % 8 of matrix l / 8.
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  // On Q (A operand): matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15).
  const int q_row = warp_row0 + (lane & 7) + (((lane >> 3) & 1) << 3), q_chunk = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < C::D / 16; ++kk) {
    uint32_t a[C::kMAtoms][4];
#pragma unroll
    for (int mi = 0; mi < C::kMAtoms; ++mi) {
      if constexpr (C::kQInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[mi][r] = qf[mi][kk][r];
      } else {
        ldmatrix_x4(a[mi], swizzled<C::D>(q_smem, q_row + mi * 16, 2 * kk + q_chunk));
      }
    }
#pragma unroll
    for (int np = 0; np < C::kBlockN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, swizzled<C::D>(k_smem, np * 16 + k_row, 2 * kk + k_chunk));
#pragma unroll
      for (int mi = 0; mi < C::kMAtoms; ++mi) {
        Mma<T>::run(s[mi][2 * np], a[mi], b[0], b[1]);
        Mma<T>::run(s[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// O += P V with P taken from the S fragments (already exponentiated) and V read transposed by ldmatrix.trans:
// matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15) -> b0/b1 of two d tiles.
template <class C>
__device__ __forceinline__ void pv_tile(float (&o)[C::kMAtoms][C::D / 8][4],
                                        const float (&s)[C::kMAtoms][C::kBlockN / 8][4], uint32_t v_smem, int lane) {
  using T = typename C::T;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
    uint32_t a[C::kMAtoms][4];
#pragma unroll
    for (int mi = 0; mi < C::kMAtoms; ++mi) {
      a[mi][0] = Mma<T>::pack(s[mi][2 * kk][0], s[mi][2 * kk][1]);
      a[mi][1] = Mma<T>::pack(s[mi][2 * kk][2], s[mi][2 * kk][3]);
      a[mi][2] = Mma<T>::pack(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
      a[mi][3] = Mma<T>::pack(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < C::D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, swizzled<C::D>(v_smem, kk * 16 + v_row, 2 * dp + v_chunk));
#pragma unroll
      for (int mi = 0; mi < C::kMAtoms; ++mi) {
        Mma<T>::run(o[mi][2 * dp], a[mi], b[0], b[1]);
        Mma<T>::run(o[mi][2 * dp + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

}  // namespace prefill
}  // namespace hf_paged

#include "paged_prefill_fp8.cuh"
#include "paged_prefill_main.cuh"
