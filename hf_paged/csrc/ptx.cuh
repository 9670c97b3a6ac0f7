// The PTX both attention kernels are built from: cp.async, ldmatrix, mma.sync m16n8k16, the swizzled shared-memory
// tile layout they share, and a bare ex2. One copy, so decode and prefill cannot drift apart.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * g + t:
//   A 16x16 (row-major): a0 = (row g, cols 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 = (k 2t..2t+1, col g),    b1 = (k 2t+8..2t+9, col g)
//   C 16x8  fp32:        c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// So the C fragments of two adjacent 8-column tiles, rounded to 16 bits, are exactly the A fragment of one
// 16-wide k step: P never leaves registers between the two matrix products.
//
// `asm volatile` on every statement that touches memory or the tensor cores (as CUTLASS writes them): the compiler
// keeps their order relative to each other, which the cp.async groups rely on. ldmatrix carries no "memory"
// clobber: the shared memory it reads is written by cp.async (ordered by the wait_group before it) or by plain
// stores that other lanes read too, which already sit behind __syncwarp/__syncthreads (compiler barriers). ex2 is
// a pure function of its operand and stays plain `asm`, free to be scheduled.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace hf_paged {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when !valid nothing is read and the 16 bytes are zero-filled (rows past the end
// of a sequence must be zeros, not stale data: a NaN there would survive the 0 * NaN of the P.V product).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Tiles are [rows][D] 16-bit elements, rows of D / 8 16-byte chunks, in one of two layouts:
// - D a multiple of 64: chunk c of row r is stored at chunk c ^ (r & 7). The 8 row addresses of one ldmatrix 8x8
//   matrix (8 consecutive rows, one chunk column) then fall in 8 different bank groups instead of all in one, and
//   the 16-byte cp.async writes of a row stay a permutation inside the row.
// - any other multiple of 16 (32, 80, 96, 112, 160): rows padded by one chunk, a pitch of D / 8 + 1 chunks. That
//   pitch is odd, so 8 consecutive rows of one chunk column again land in 8 different bank groups; the XOR could not
//   be used, as it would move a chunk past the end of a row whose chunk count is not a multiple of 8.
// `tile_pitch` is the row stride in elements, `swizzle` the element offset of (row, chunk), `swizzled` its
// shared-memory address from a tile's base.
template <int D>
__host__ __device__ constexpr int tile_pitch() {
  static_assert(D % 16 == 0, "tiles hold whole 16-wide mma k-steps");
  return D % 64 == 0 ? D : D + 8;
}
template <int D>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (D % 64 == 0) {
    return row * D + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * tile_pitch<D>() + (chunk << 3);
  }
}
template <int D>
__device__ __forceinline__ uint32_t swizzled(uint32_t tile, int row, int chunk) {
  return tile + static_cast<uint32_t>(swizzle<D>(row, chunk)) * 2u;
}

// 2^x as the bare MUFU.EX2: exp2f would add denormal fix-ups around it. For inputs <= 0 (scores minus their
// running max) flushing results below 2^-126 to zero changes nothing that matters.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Logit softcapping of a raw score: cap * tanh(x / cap), with tanh(y) = 1 - 2 / (1 + 2^(2 y log2(e))): one MUFU.EX2
// and one MUFU.RCP, absolute error ~1e-6 of the cap. (tanh.approx.f32 is one MUFU op, but its relative error of
// 2^-11 is ~0.02 on a score near Gemma2's cap of 50, coarser than the bf16 rounding of the probabilities.) Large |y|
// give 2^y = inf or 0, hence exactly +1 or -1. `exp_scale` = softcap_exp_scale(1 / cap), computed once per tile.
__device__ __forceinline__ float softcap_exp_scale(float inv_cap) { return inv_cap * 2.8853900817779268f; }
__device__ __forceinline__ float softcapped(float x, float cap, float exp_scale) {
  return cap * (1.f - __fdividef(2.f, 1.f + fast_exp2(x * exp_scale)));
}

// D += A B for one m16n8k16 tile with fp32 accumulators; `pack` rounds two fp32 values to one A/B register.
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

}  // namespace hf_paged
