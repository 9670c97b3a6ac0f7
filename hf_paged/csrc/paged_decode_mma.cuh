// Paged decode on tensor cores (fp16 / bf16): mma.sync m16n8k16 with the query heads of one kv head as the M rows.
//
// Grid (split, kv_head * head_groups + head_group, sequence); 128 threads. One CTA reads one kv head's K/V over
// one split, once, for up to 16 query heads (GQA: the group's heads are the MMA rows; padding rows are zero and
// never written). Each warp takes every 4th 16-token tile of the split and streams it through its own cp.async
// ring (`kStages` deep, rows swizzled as in ptx.cuh so ldmatrix is conflict-free), so warps need only __syncwarp:
//   S[16 x 16] = Q K^T      (D/16 k-steps x 2 n-tiles; K tile read with ldmatrix)
//   online softmax in base 2 on the S fragments (row max over the 4-lane quad, lazy rescale)
//   O[16 x D] += P V        (P re-used from the S registers as the A operand; V read with ldmatrix.trans)
// The CUDA-core version (paged_decode_simt.cuh) spent ~450 instructions per 4 KB of KV and could not keep the
// memory busy; this one spends ~160 per 8 KB, and copies whole 128-byte lines per instruction. The kernel is in paged_decode_mma_kernel.cuh; the epilogue and the
// split-K combine in decode_common.cuh.
#pragma once

#include "decode_common.cuh"

namespace hf_paged {
namespace decode {

// Scores are in log2 units; the running max moves (rescaling O) only when beaten by more than this.
constexpr float kMmaRescaleThreshold = 8.0f;

template <int D>
struct MmaConfig {
  static constexpr int kRows = 16;       // query heads per CTA: the MMA's M
  static constexpr int kTokens = 16;     // tokens per warp step: two n-tiles of QK^T, one k-step of PV
  static constexpr int kChunks = D / 8;  // 16-byte chunks per K/V row
  // ~24 KB of ring per warp: 2 CTAs (8 warps) per SM, each warp with (kStages - 1) tiles of K+V in flight.
  static constexpr int kStages = cmax(2, cmin(6, 24576 / (64 * D)));
  static constexpr int kTileBytes = kTokens * tile_pitch<D>() * 2;  // one K (or V) tile (ptx.cuh's layout)
  static constexpr int kWarpRingBytes = kStages * 2 * kTileBytes;
  static constexpr int kSmemBytes = cmax(kWarps * kWarpRingBytes, Reduce<D, kRows>::kBytes);
  static constexpr int kCtaTile = kWarps * kTokens;  // split lengths are multiples of this
  // Splits below 512 tokens lost at every batch on the H200 (B=1, ctx 8192: 512 -> 13.9 us, 256 -> 14.6-15.5 us;
  // B=8, ctx 4096: 1024-2048 best): each CTA's fixed prologue and epilogue must be amortised.
  static constexpr int kMinSplit = 512;
};

// One warp copies one 16-token tile of K and V. Lanes 0-15 look up one token's slot each; then the warp's copy
// instructions walk the tile's rows back to back, 32 consecutive 16-byte chunks each (2 rows of 256 B at head_dim
// 128, 1.6 rows at 80), i.e. whole 128-byte lines, as a streaming copy would: v2 took 32 B of 16 rows per
// instruction and reached only 74% of the copy bandwidth.
template <typename T, int D>
__device__ __forceinline__ void issue_tile(const DecodeParams& p, uint32_t k_tile, int t0, const CtaWork& w,
                                           const int* table, int lane) {
  using C = MmaConfig<D>;
  constexpr int kCopies = C::kTokens * C::kChunks / 32;  // a whole number: D is a multiple of 16
  const int t = t0 + (lane & 15);
  int slot = -1;  // physical token slot (block * block_size + offset); -1 past the split
  if (lane < 16 && t < w.t_end) {
    const int blk = block_of(t, p);
    slot = table[blk - w.blk_first] * p.block_size + (t - blk * p.block_size);
  }
  const T* k_base = static_cast<const T*>(p.k_cache);
  const T* v_base = static_cast<const T*>(p.v_cache);
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    int row, c;
    if constexpr (32 % C::kChunks == 0 || C::kChunks % 32 == 0) {  // whole rows per instruction, or whole lines
      constexpr int kLanesPerRow = cmin(32, C::kChunks);
      row = i * (32 / kLanesPerRow) + lane / kLanesPerRow, c = lane % kLanesPerRow;
    } else {
      const int idx = i * 32 + lane;
      row = idx / C::kChunks, c = idx % C::kChunks;
    }
    const int s = __shfl_sync(0xffffffffu, slot, row);
    const bool valid = s >= 0;
    const int64_t off = (static_cast<int64_t>(s) * p.num_kv_heads + w.kvh) * D + c * 8;
    const uint32_t dst = swizzled<D>(k_tile, row, c);
    cp_async16(dst, valid ? k_base + off : k_base, valid);
    cp_async16(dst + C::kTileBytes, valid ? v_base + off : v_base, valid);
  }
}

// Q as MMA A fragments for every k-step: rows lane/4 and lane/4 + 8, dims 2*(lane%4) (+1, +8, +9).
template <typename T, int D>
__device__ __forceinline__ void load_q_fragments(const DecodeParams& p, const CtaWork& w, int lane,
                                                 uint32_t (&qa)[D / 16][4]) {
  const T* base = static_cast<const T*>(p.query) + w.b * p.q_stride_b;
  const int g0 = lane >> 2, kc = 2 * (lane & 3);
  const bool v0 = g0 < w.valid_heads, v1 = g0 + 8 < w.valid_heads;
  const T* r0 = base + (w.head0 + g0) * p.q_stride_h + kc;
  const T* r1 = base + (w.head0 + g0 + 8) * p.q_stride_h + kc;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    qa[ks][0] = v0 ? *reinterpret_cast<const uint32_t*>(r0 + ks * 16) : 0u;
    qa[ks][1] = v1 ? *reinterpret_cast<const uint32_t*>(r1 + ks * 16) : 0u;
    qa[ks][2] = v0 ? *reinterpret_cast<const uint32_t*>(r0 + ks * 16 + 8) : 0u;
    qa[ks][3] = v1 ? *reinterpret_cast<const uint32_t*>(r1 + ks * 16 + 8) : 0u;
  }
}

// Per-thread softmax state: rows lane/4 (index 0) and lane/4 + 8 (index 1); O holds this lane's columns.
template <int D>
struct MmaState {
  float o[D / 8][4];
  float m[2];
  float l[2];  // partial over this lane's columns; summed over the quad at the end
};

}  // namespace decode
}  // namespace hf_paged
