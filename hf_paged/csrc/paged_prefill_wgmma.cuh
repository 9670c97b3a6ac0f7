// Paged varlen prefill on Hopper's warpgroup tensor cores (sm_90a wgmma): the same arguments and results as
// paged_prefill_kernel (PrefillParams), another way to do the two matrix products.
//
// - A CTA of two warpgroups owns 128 query rows of one (sequence, head), 64 per warpgroup, and walks the sequence's
//   K/V in kBlockN-key tiles (128 up to head_dim 128, 64 above: O's registers grow with head_dim). Head sizes: the
//   multiples of 16 from 32 to 256 that are compiled (a 16-wide k step is 32 bytes inside a panel; the last 64-column
//   panel is partly used below a multiple of 64, see Traits::kPanels).
// - Q, K and V tiles sit in shared memory in wgmma's 128-byte-swizzled layout (wgmma.cuh). S = Q K^T reads both
//   from shared memory (K-major); O += P V takes P from registers (the exponentiated S, rounded to 16 bits) and V
//   from shared memory, transposed (MN-major). Each product is one commit group. Two kernels: the serial one waits
//   for each product before using its result (paged_prefill_wgmma_main.cuh), the pipelined one runs the softmax of
//   the next tile while P V runs (paged_prefill_wgmma_pipelined.cuh).
// - K/V arrive by cp.async through the block table, two stages deep, with paged_prefill_kernel's copies (its
//   issue_kv_tile in the serial kernel, slot lookups ahead of use); the online softmax, the causal / window masks,
//   softcapping and the epilogue are that kernel's code too (paged_prefill_main.cuh): the wgmma accumulator of a
//   warp is the mma.sync C fragment layout those helpers index, with one 16-row atom per warp.
// - Capture-safe: no allocation, every per-sequence decision made on the device from the launch arguments.
#pragma once

#include "paged_prefill_kernel.cuh"
#include "wgmma.cuh"

namespace hf_paged {
namespace prefill_wgmma {

template <typename T_, int D_>
struct Traits {
  static_assert(D_ % 16 == 0 && D_ >= 32 && D_ <= 256, "wgmma prefill: head_dim a multiple of 16, 32 to 256");
  using T = T_;
  using KV = T_;
  static constexpr bool kFp8 = false;
  static constexpr int D = D_;
  static constexpr int kWarps = 8, kThreads = 256;  // two warpgroups
  static constexpr int kMAtoms = 1, kWarpRows = 16;  // per warp, as the shared softmax / epilogue helpers see it
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = D <= 128 ? 128 : 64;
  // CTAs per SM the registers must leave room for: two at head_dim 32 (at most 128 registers a thread), where one
  // CTA's 8 warps could not hide the softmax between products that short; one above.
  static constexpr int kMinBlocks = D <= 32 ? 2 : 1;
  static constexpr int kChunks = D / 8;
  // 64-column panels per tile; head sizes that are not a multiple of 64 leave the last one partly unused (never
  // written, never read: the k steps and the P V product's N stop at D).
  static constexpr int kPanels = (D + 63) / 64;
  // A thread keeps one chunk column when kThreads is a multiple of kChunks (32, 64, 128, 256); otherwise its copies
  // walk the tile's chunks end to end (prefill::copy_slot).
  static constexpr bool kFixedChunk = kThreads % kChunks == 0;
  static constexpr int kKVCopies = (kBlockN * kChunks + kThreads - 1) / kThreads;
  static constexpr int kQCopies = (kBlockM * kChunks + kThreads - 1) / kThreads;
  static constexpr int kQBytes = kBlockM * kPanels * 128, kTileBytes = kBlockN * kPanels * 128;  // Q; a K or V stage
  static constexpr int kKOffset = kQBytes, kVOffset = kKOffset + 2 * kTileBytes;  // from the 1024-aligned base
  static constexpr int kSlotsOffset = kVOffset + 2 * kTileBytes;
  // + slots[2][kBlockN], + up to 1008 bytes to align the base (dynamic shared memory is only 16-byte aligned).
  static constexpr int kSmemBytes = kSlotsOffset + 2 * kBlockN * static_cast<int>(sizeof(int)) + 1024;
  // The epilogue stages O in the Q tile with the mma kernel's layout (prefill::store_output).
  static_assert(kBlockM * tile_pitch<D>() * 2 <= kQBytes, "the output stage fits in the Q tile");
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory");
  __device__ __forceinline__ static uint32_t kv_offset(int row, int chunk) {
    return wgmma::sw128_offset<kBlockN>(row, chunk);
  }
  // This thread's column offset (elements) added to every copy's source: its fixed chunk, or 0 when copies walk.
  __device__ __forceinline__ static int fixed_col(int tid) { return kFixedChunk ? tid % kChunks * 8 : 0; }
};

// Accumulators as the flat register list the wgmma asm takes (the same registers).
template <int A, int B>
__device__ __forceinline__ float (&flat(float (&x)[1][A][B]))[A * B] {
  return reinterpret_cast<float(&)[A * B]>(x);
}

// Issues S = Q K^T for this warpgroup's 64 rows over one tile as one commit group: s[0][nt] is then the 16x8 C
// fragment of key columns 8nt.. of this warp's rows. q_rows: the warpgroup's first Q row in panel 0; the Q tile's
// panels hold kBlockM rows each. s may be read after wgmma::wait covers the group and fence_operands(flat(s)).
template <class C>
__device__ __forceinline__ void qk_issue(float (&s)[1][C::kBlockN / 8][4], uint32_t q_rows, uint32_t k_tile) {
  using T = typename C::T;
  float(&d)[C::kBlockN / 2] = flat(s);
  wgmma::fence_operands(d);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < C::D / 16; ++kk) {
    const uint32_t col = (kk & 3) * 32;  // 16 elements of the 64-wide panel kk / 4
    const uint64_t a = wgmma::sw128_desc(q_rows + (kk >> 2) * C::kBlockM * 128 + col, 16, 1024);
    const uint64_t b = wgmma::sw128_desc(k_tile + (kk >> 2) * C::kBlockN * 128 + col, 16, 1024);
    wgmma::Mma64<T, C::kBlockN>::ss(d, a, b, kk > 0);
  }
  wgmma::commit();
}

// P: the S fragments (already exponentiated) rounded to 16 bits, as the A fragments of 16-key steps.
template <class C>
__device__ __forceinline__ void pack_p(uint32_t (&a)[C::kBlockN / 16][4], const float (&s)[1][C::kBlockN / 8][4]) {
  using T = typename C::T;
#pragma unroll
  for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
    a[kk][0] = Mma<T>::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
    a[kk][1] = Mma<T>::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
    a[kk][2] = Mma<T>::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    a[kk][3] = Mma<T>::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// Issues O += P V as one commit group: 16 keys per step, V's panels kBlockN * 128 bytes apart. Neither o nor p may
// be touched until wgmma::wait covers the group (then fence_operands(flat(o))): the tensor cores read and write
// them asynchronously.
template <class C>
__device__ __forceinline__ void pv_issue(float (&o)[1][C::D / 8][4], const uint32_t (&p)[C::kBlockN / 16][4],
                                         uint32_t v_tile) {
  using T = typename C::T;
  float(&d)[C::D / 2] = flat(o);
  wgmma::fence_operands(d);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < C::kBlockN / 16; ++kk)
    wgmma::Mma64<T, C::D>::rs(d, p[kk], wgmma::sw128_desc(v_tile + kk * 16 * 128, C::kBlockN * 128, 1024), 1);
  wgmma::commit();
}

// This thread's 16-byte copies of one tile of `cache` (K or V) into dst (head_off: kv_head * D + C::fixed_col), rows
// found through slots as in prefill::issue_kv_tile (which copies K and V of one tile together); the pipelined kernel moves K a tile ahead of V.
template <class C>
__device__ __forceinline__ void issue_cache_tile(const PrefillParams& p, const void* cache, int64_t head_off,
                                                 const int* slots, uint32_t dst, int tid) {
  using T = typename C::T;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * C::D;
#pragma unroll
  for (int i = 0; i < C::kKVCopies; ++i) {
    int row, chunk;
    if (!prefill::copy_slot<C, C::kBlockN>(tid, i, row, chunk)) break;
    const int slot = slots[row];
    const bool valid = slot >= 0;
    const int64_t off = valid ? slot * row_stride + head_off + (C::kFixedChunk ? 0 : chunk * 8) : 0;
    cp_async16(dst + C::kv_offset(row, chunk), static_cast<const T*>(cache) + off, valid);
  }
}

// This thread's share of the Q tile (rows past the sequence zero-filled), as one commit group.
template <class C>
__device__ __forceinline__ void issue_q_tile(const PrefillParams& p, uint32_t q_smem, int head, int q_start,
                                            int q_len, int m0, int tid) {
  using T = typename C::T;
  const T* q = static_cast<const T*>(p.query) + head * p.q_stride_h + C::fixed_col(tid);
#pragma unroll
  for (int i = 0; i < C::kQCopies; ++i) {
    int r, chunk;
    if (!prefill::copy_slot<C, C::kBlockM>(tid, i, r, chunk)) break;
    const bool valid = m0 + r < q_len;
    const T* src = q + (C::kFixedChunk ? 0 : chunk * 8) + (valid ? (q_start + m0 + r) * p.q_stride_t : 0);
    cp_async16(q_smem + wgmma::sw128_offset<C::kBlockM>(r, chunk), src, valid);
  }
  cp_async_commit();
}

}  // namespace prefill_wgmma
}  // namespace hf_paged

#include "paged_prefill_wgmma_main.cuh"
#include "paged_prefill_wgmma_pipelined.cuh"
