// The prefill kernel over an e4m3 (float8_e4m3fn) cache: what differs from a cache in the query's dtype.
//
// - K/V tiles arrive by cp.async as e4m3 bytes (half the bytes of a 16-bit tile) into a two-stage staging area,
//   rows of D bytes end to end.
// - Once a tile has landed, the CTA widens it to the query's dtype, once, into one 16-bit K and one V tile in the
//   swizzled layout of the 16-bit kernel (each e4m3 value is exact in fp16 and in bf16); the ldmatrix + mma path then
//   runs unchanged. Widening in registers, as decode does, would repeat the conversion in every warp of the CTA
//   (each warp reads the whole tile); here it is done once per tile and CTA.
// - Scales as in decode: K's folded into the softmax scale (and the softcap), V's into the final normalisation.
//
// The main loop (paged_prefill_main.cuh) orders it so that a tile still costs two barriers: wait for tile n's bytes,
// barrier, widen tile n and write the slots of tile n + 2, barrier, MMAs. The next iteration's copies into the
// staging half just widened, and its widening into the 16-bit tiles the MMAs read, both come after a barrier.
#pragma once

#include <cfloat>

namespace hf_paged {
namespace prefill {

// Copies this thread's 16-byte chunks of one e4m3 K/V tile into the staging rows (rows of D bytes). kv_off =
// kv_head * D + this thread's chunk column * 16 (bytes = elements); slots as in issue_kv_tile.
template <class C>
__device__ __forceinline__ void issue_kv_tile_e4m3(const PrefillParams& p, int64_t kv_off, const int* slots,
                                                   uint32_t k_dst, uint32_t v_dst, int tid) {
  constexpr int kRawChunks = C::D / 16;
  static_assert(C::kThreads % kRawChunks == 0 && C::kBlockN * kRawChunks % C::kThreads == 0, "whole rows per step");
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * C::D;
  const int chunk = tid % kRawChunks;
#pragma unroll
  for (int i = 0; i < C::kBlockN * kRawChunks / C::kThreads; ++i) {
    const int row = tid / kRawChunks + i * (C::kThreads / kRawChunks);
    const int slot = slots[row];
    const bool valid = slot >= 0;
    const int64_t off = valid ? slot * row_stride + kv_off : 0;
    const uint32_t dst = static_cast<uint32_t>(row * C::D + chunk * 16);
    cp_async16(k_dst + dst, static_cast<const E4M3*>(p.k_cache) + off, valid);
    cp_async16(v_dst + dst, static_cast<const E4M3*>(p.v_cache) + off, valid);
  }
}

// Widens one staged e4m3 tile (raw: [kBlockN][D] bytes) into the 16-bit swizzled tile `dst`: each thread turns 8
// bytes into one 16-byte chunk. A quarter warp writes 8 chunks of one row that the swizzle only permutes, and reads
// 64 contiguous bytes: both bank-conflict free. Zero-filled rows (slot -1) stay zeros.
template <class C>
__device__ __forceinline__ void widen_tile(const unsigned char* raw, typename C::T* dst, int tid) {
  using T = typename C::T;
  const int chunk = tid % C::kChunks;
#pragma unroll
  for (int i = 0; i < C::kBlockN * C::kChunks / C::kThreads; ++i) {
    const int row = tid / C::kChunks + i * (C::kThreads / C::kChunks);
    const uint2 bytes = *reinterpret_cast<const uint2*>(raw + row * C::D + chunk * 8);
    const uint4 wide = {e4m3x2_to<T>(bytes.x), e4m3x2_to<T>(bytes.x >> 16), e4m3x2_to<T>(bytes.y),
                        e4m3x2_to<T>(bytes.y >> 16)};
    *reinterpret_cast<uint4*>(dst + swizzle<C::D>(row, chunk)) = wide;
  }
}

// The scalars a CTA scores and normalises with. An e4m3 cache folds its kv head's scales in, as decode does
// (paged_decode_mma.cuh, cta_scale): q.(k8 ks) = ks q.k8, softcap(ks x) = ks (cap / ks) tanh(x / (cap / ks)), and
// sum p (v8 vs) = vs sum p v8. The kernel takes the running max over raw scores and multiplies by the scale
// afterwards, so a K scale of 0 (a head never written, or all zeros) is raised to the smallest normal float: every
// score is then ~0 as over dequantized zeros, while masked keys stay -inf instead of -inf * 0 = NaN.
struct CtaScale {
  float scale_log2, softcap, softcap_inv, out_scale;
};

template <class C>
__device__ __forceinline__ CtaScale cta_scale(const PrefillParams& p, int kv_head) {
  CtaScale c{p.scale_log2, p.softcap, p.softcap_inv, 1.f};
  if constexpr (C::kFp8) {
    const float ks = p.k_scale[kv_head];
    c.out_scale = p.v_scale[kv_head];
    c.scale_log2 = fmaxf(c.scale_log2 * ks, FLT_MIN);
    if (ks > 0.f) c.softcap /= ks, c.softcap_inv *= ks;
  }
  return c;
}

}  // namespace prefill
}  // namespace hf_paged
