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
//
// An e4m3 cache (KV = E4M3, fp16 / bf16 query) streams half the bytes through the same rings and is unpacked in
// registers (paged_decode_mma_fp8.cuh): K's per-head scale is folded into the softmax scale, V's into the output.
#pragma once

#include "decode_common.cuh"
#include "fp8.cuh"

namespace hf_paged {
namespace decode {

// Scores are in log2 units; the running max moves (rescaling O) only when beaten by more than this.
constexpr float kMmaRescaleThreshold = 8.0f;

// kKvBytes: bytes of one cache element (2: the query's dtype; 1: e4m3).
template <int D, int kKvBytes = 2>
struct MmaConfig {
  static constexpr int kRows = 16;       // query heads per CTA: the MMA's M
  static constexpr int kTokens = 16;     // tokens per warp step: two n-tiles of QK^T, one k-step of PV
  static constexpr int kChunks = D * kKvBytes / 16;  // 16-byte chunks per K/V row
  // ~24 KB of ring per warp: 2 CTAs (8 warps) per SM, each warp with (kStages - 1) tiles of K+V in flight.
  static constexpr int kStages = cmax(2, cmin(6, 24576 / (32 * D * kKvBytes)));
  // One K (or V) tile: ptx.cuh's layout for 16-bit rows, rows of D bytes (fp8_chunk) for e4m3.
  static constexpr int kTileBytes = kTokens * (kKvBytes == 2 ? tile_pitch<D>() * 2 : D);
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
// e4m3 tiles: rows of D bytes, chunk c of row r stored at chunk c ^ fp8_chunk_xor<D>(r). The XOR keeps the unpacking
// reads of paged_decode_mma_fp8.cuh free of bank conflicts at D = 128 and 256: K reads chunks t + 4i of rows g and
// g + 1 in one quarter warp (so odd rows flip bit 2), V reads chunk g of rows 2t (+1, +8, +9) for t = 0..3 (so bits 1-2
// of the XOR are a permutation of t). At D = 64 two rows share a 128-byte line and only the K reads are kept free.
template <int D>
__device__ __forceinline__ int fp8_chunk_xor(int row) {
  static_assert(D == 64 || D % 128 == 0, "e4m3 tiles are laid out for head_dim 64 or a multiple of 128");
  if constexpr (D == 64) {
    return (row >> 1) & 3;
  } else {
    return (row & 6) ^ ((row & 1) << 2);
  }
}
template <int D>
__device__ __forceinline__ uint32_t fp8_chunk(uint32_t tile, int row, int chunk) {
  return tile + static_cast<uint32_t>(row * D + ((chunk ^ fp8_chunk_xor<D>(row)) << 4));
}

// Shared-memory address of 16-byte chunk `c` of tile row `row` for cache elements of `KV`.
template <typename KV, int D>
__device__ __forceinline__ uint32_t tile_chunk(uint32_t tile, int row, int c) {
  if constexpr (sizeof(KV) == 1) {
    return fp8_chunk<D>(tile, row, c);
  } else {
    return swizzled<D>(tile, row, c);
  }
}

template <typename KV, int D>
__device__ __forceinline__ void issue_tile(const DecodeParams& p, uint32_t k_tile, int t0, const CtaWork& w,
                                           const int* table, int lane) {
  using C = MmaConfig<D, sizeof(KV)>;
  constexpr int kCopies = C::kTokens * C::kChunks / 32;  // a whole number: D is a multiple of 16 (of 32 for e4m3)
  constexpr int kChunkElems = 16 / sizeof(KV);
  const int t = t0 + (lane & 15);
  int slot = -1;  // physical token slot (block * block_size + offset); -1 past the split
  if (lane < 16 && t < w.t_end) {
    const int blk = block_of(t, p);
    slot = table[blk - w.blk_first] * p.block_size + (t - blk * p.block_size);
  }
  const KV* k_base = static_cast<const KV*>(p.k_cache);
  const KV* v_base = static_cast<const KV*>(p.v_cache);
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
    const int64_t off = (static_cast<int64_t>(s) * p.num_kv_heads + w.kvh) * D + c * kChunkElems;
    const uint32_t dst = tile_chunk<KV, D>(k_tile, row, c);
    cp_async16(dst, valid ? k_base + off : k_base, valid);
    cp_async16(dst + C::kTileBytes, valid ? v_base + off : v_base, valid);
  }
}

// The head dims that k-step `ks` puts in the k-slots 2t, 2t+1 (returned) and 2t+8, 2t+9 (returned + `hi`) of lane
// quad position t. 16-bit caches: the natural order (ldmatrix reads it). e4m3 caches: dims (t + 4 (ks / 4)) * 16 +
// 4 (ks % 4) + 0..3, so that lane t's K slice of a row is whole 16-byte chunks; a q.k sum is the same in any order
// as long as Q's fragments use the K fragments' order.
template <bool kFp8>
__device__ __forceinline__ int k_slot_dim(int ks, int t, int& hi) {
  if constexpr (kFp8) {
    hi = 2;
    return (t + 4 * (ks >> 2)) * 16 + 4 * (ks & 3);
  } else {
    hi = 8;
    return ks * 16 + 2 * t;
  }
}

// Q as MMA A fragments for every k-step: rows lane/4 and lane/4 + 8, dims k_slot_dim (2*(lane%4) (+1, +8, +9)).
template <typename T, int D, bool kFp8 = false>
__device__ __forceinline__ void load_q_fragments(const DecodeParams& p, const CtaWork& w, int lane,
                                                 uint32_t (&qa)[D / 16][4]) {
  const T* base = static_cast<const T*>(p.query) + w.b * p.q_stride_b;
  const int g0 = lane >> 2;
  const bool v0 = g0 < w.valid_heads, v1 = g0 + 8 < w.valid_heads;
  const T* r0 = base + (w.head0 + g0) * p.q_stride_h;
  const T* r1 = base + (w.head0 + g0 + 8) * p.q_stride_h;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    int hi;
    const int d = k_slot_dim<kFp8>(ks, lane & 3, hi);
    qa[ks][0] = v0 ? *reinterpret_cast<const uint32_t*>(r0 + d) : 0u;
    qa[ks][1] = v1 ? *reinterpret_cast<const uint32_t*>(r1 + d) : 0u;
    qa[ks][2] = v0 ? *reinterpret_cast<const uint32_t*>(r0 + d + hi) : 0u;
    qa[ks][3] = v1 ? *reinterpret_cast<const uint32_t*>(r1 + d + hi) : 0u;
  }
}

// The scalars a CTA scores with: the softmax scale (log2 units) and softcap, and the scale of its output. An e4m3
// cache folds its kv head's scales in: q.(k8 * ks) = ks * q.k8, softcap(ks x) = ks * (cap/ks) tanh(x / (cap/ks)),
// and sum p (v8 * vs) = vs * sum p v8. A scale of 0 (a head never written) leaves scores 0, as dequantized zeros do.
struct CtaScale {
  float scale_log2, softcap, softcap_inv, v_scale;
};

template <bool kFp8>
__device__ __forceinline__ CtaScale cta_scale(const DecodeParams& p, int kvh) {
  CtaScale c{p.scale_log2, p.softcap, p.softcap_inv, 1.f};
  if constexpr (kFp8) {
    const float ks = p.k_scale[kvh];
    c.v_scale = p.v_scale[kvh];
    c.scale_log2 *= ks;
    if (ks > 0.f) c.softcap /= ks, c.softcap_inv *= ks;
  }
  return c;
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
