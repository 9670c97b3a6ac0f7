// The sm_90a warpgroup matrix products (wgmma) the Hopper prefill is built from: shared-memory matrix descriptors
// for 128-byte-swizzled tiles, the fence / commit / wait protocol, and m64nNk16 products with fp32 accumulators.
// Only for translation units compiled for sm_90a (-gencode=arch=compute_90a,code=sm_90a).
//
// Accumulator layout (PTX ISA, "Register Fragments" for wgmma .m64nNk16): warp w of the warpgroup holds rows
// 16w..16w+15, and within a warp register 4j + e is the mma.sync m16n8 C fragment of column tile j (lane = 4g + t:
// e = 0, 1 at (row g, cols 8j + 2t, +1), e = 2, 3 at row g + 8). An A operand in registers is the m16n8k16 A fragment
// of the warp's 16 rows (ptx.cuh), so exponentiated score tiles become the A of the P.V product as with mma.sync.
//
// Tile layout both operands use (`sw128_offset`): a tile of R rows and D 16-bit columns is ceil(D / 64) panels of
// [R][64] elements (the last one partly used when D is not a multiple of 64: a product's k steps or N stop at D),
// 128-byte rows, 16-byte chunk c of row r stored at chunk c ^ (r & 7). That is the
// hardware's 128-byte swizzle (address bits 4-6 XOR bits 7-9), so panels must start on 1024-byte boundaries. Read as
// - K-major (rows = M or N, columns = the contraction): a 16-wide k step is 32 bytes at (k / 64) * R * 128 +
//   (k % 64) * 2 from the tile; SBO = 1024 (the next 8 rows), LBO unused (1);
// - MN-major (rows = the contraction, columns = N; trans-b = 1, 16-bit types only): a 16-row k step starts at
//   k * 128; LBO = R * 128 (the next 64 columns: the next panel), SBO = 1024 (the next 8 rows).
//
// The asm statements are `volatile` with a "memory" clobber where they order shared memory or the async groups.
// Accumulators pass as "+f" operands, but wgmma writes them asynchronously: `fence_operands` before `fence` and
// after `wait` keeps the compiler from moving other reads or writes of them across the pair.
#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.cuh needs an sm_90a device pass: -gencode=arch=compute_90a,code=sm_90a"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace hf_paged {
namespace wgmma {

// Byte offset of (row, 16-byte chunk) in a 128-byte-swizzled tile of kRows rows (see above).
template <int kRows>
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>(((chunk >> 3) * kRows + row) * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// A shared-memory matrix descriptor with 128-byte swizzling: start address, leading and stride byte offsets
// (each stored >> 4 in 14 bits), base offset 0 (panels start on 1024-byte boundaries), mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  auto enc = [](uint32_t x) { return static_cast<uint64_t>((x & 0x3FFFF) >> 4); };
  return enc(addr) | enc(lbo) << 16 | enc(sbo) << 32 | uint64_t{1} << 62;
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, plain stores) and read next by wgmma (the async proxy):
// each writing thread fences after its writes complete and before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Inline asm takes no operand arrays, so the accumulator lists are spelled out: eight registers per macro.
#define HF_PAGED_ACC8(i)                                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define HF_PAGED_ACC32(i) HF_PAGED_ACC8(i), HF_PAGED_ACC8(i + 8), HF_PAGED_ACC8(i + 16), HF_PAGED_ACC8(i + 24)
#define HF_PAGED_ACC_32 HF_PAGED_ACC8(0), HF_PAGED_ACC8(8)
#define HF_PAGED_ACC_64 HF_PAGED_ACC32(0)
#define HF_PAGED_ACC_80 HF_PAGED_ACC32(0), HF_PAGED_ACC8(32)
#define HF_PAGED_ACC_96 HF_PAGED_ACC32(0), HF_PAGED_ACC8(32), HF_PAGED_ACC8(40)
#define HF_PAGED_ACC_112 HF_PAGED_ACC32(0), HF_PAGED_ACC8(32), HF_PAGED_ACC8(40), HF_PAGED_ACC8(48)
#define HF_PAGED_ACC_128 HF_PAGED_ACC32(0), HF_PAGED_ACC32(32)
#define HF_PAGED_ACC_160 HF_PAGED_ACC32(0), HF_PAGED_ACC32(32), HF_PAGED_ACC8(64), HF_PAGED_ACC8(72)
#define HF_PAGED_ACC_192 HF_PAGED_ACC32(0), HF_PAGED_ACC32(32), HF_PAGED_ACC32(64)
#define HF_PAGED_ACC_256 HF_PAGED_ACC32(0), HF_PAGED_ACC32(32), HF_PAGED_ACC32(64), HF_PAGED_ACC32(96)
#define HF_PAGED_REGS_0_15 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define HF_PAGED_REGS_32_39 "%32, %33, %34, %35, %36, %37, %38, %39"
#define HF_PAGED_REGS_32_47 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define HF_PAGED_REGS_48_55 "%48, %49, %50, %51, %52, %53, %54, %55"
#define HF_PAGED_REGS_64_79 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define HF_PAGED_REGS_0                                                                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define HF_PAGED_REGS_32                                                                                      \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define HF_PAGED_REGS_64                                                                                      \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, " \
  "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define HF_PAGED_REGS_96                                                                                         \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, " \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define HF_PAGED_STR_32 "{" HF_PAGED_REGS_0_15 "}"
#define HF_PAGED_STR_64 "{" HF_PAGED_REGS_0 "}"
#define HF_PAGED_STR_80 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32_39 "}"
#define HF_PAGED_STR_96 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32_47 "}"
#define HF_PAGED_STR_112 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32_47 ", " HF_PAGED_REGS_48_55 "}"
#define HF_PAGED_STR_128 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32 "}"
#define HF_PAGED_STR_160 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32 ", " HF_PAGED_REGS_64_79 "}"
#define HF_PAGED_STR_192 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32 ", " HF_PAGED_REGS_64 "}"
#define HF_PAGED_STR_256 "{" HF_PAGED_REGS_0 ", " HF_PAGED_REGS_32 ", " HF_PAGED_REGS_64 ", " HF_PAGED_REGS_96 "}"

// D[64 x N] (+)= A[64 x 16] B[16 x N] for one warpgroup; `accumulate` 0 overwrites D (no zeroing needed).
//   ss: A and B K-major in shared memory (S = Q K^T: Q rows and K rows both run along head_dim);
//   rs: A in registers (four 32-bit registers of the m16n8k16 A fragment), B MN-major in shared memory (O += P V:
//       V rows run along head_dim, the output's N), read transposed.
template <typename T, int N>
struct Mma64;

// After the N / 2 accumulators: ss takes the descriptors a, b and `accumulate` at %R, %R+1, %R+2 (R = N / 2);
// rs the four A registers at %R..%R+3, b at %R+4, `accumulate` at %R+5.
#define HF_PAGED_MMA64(TYPE, TY, N, SS_A, SS_B, SS_P, RS_A, RS_B, RS_P)                                        \
  template <>                                                                                                  \
  struct Mma64<TYPE, N> {                                                                                      \
    __device__ __forceinline__ static void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N     \
                   "k16.f32." TY "." TY " " HF_PAGED_STR_##N ", " SS_A ", " SS_B ", p, 1, 1, 0, 0;\n}\n"       \
                   : HF_PAGED_ACC_##N                                                                          \
                   : "l"(a), "l"(b), "r"(accumulate));                                                         \
    }                                                                                                          \
    __device__ __forceinline__ static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,          \
                                              int accumulate) {                                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N     \
                   "k16.f32." TY "." TY " " HF_PAGED_STR_##N ", " RS_A ", " RS_B ", p, 1, 1, 1;\n}\n"          \
                   : HF_PAGED_ACC_##N                                                                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                     \
    }                                                                                                          \
  };

#define HF_PAGED_MMA64_SHAPES(TYPE, TY)                                                                       \
  HF_PAGED_MMA64(TYPE, TY, 32, "%16", "%17", "%18", "{%16, %17, %18, %19}", "%20", "%21")                     \
  HF_PAGED_MMA64(TYPE, TY, 64, "%32", "%33", "%34", "{%32, %33, %34, %35}", "%36", "%37")                     \
  HF_PAGED_MMA64(TYPE, TY, 80, "%40", "%41", "%42", "{%40, %41, %42, %43}", "%44", "%45")                     \
  HF_PAGED_MMA64(TYPE, TY, 96, "%48", "%49", "%50", "{%48, %49, %50, %51}", "%52", "%53")                     \
  HF_PAGED_MMA64(TYPE, TY, 112, "%56", "%57", "%58", "{%56, %57, %58, %59}", "%60", "%61")                    \
  HF_PAGED_MMA64(TYPE, TY, 128, "%64", "%65", "%66", "{%64, %65, %66, %67}", "%68", "%69")                    \
  HF_PAGED_MMA64(TYPE, TY, 160, "%80", "%81", "%82", "{%80, %81, %82, %83}", "%84", "%85")                    \
  HF_PAGED_MMA64(TYPE, TY, 192, "%96", "%97", "%98", "{%96, %97, %98, %99}", "%100", "%101")                  \
  HF_PAGED_MMA64(TYPE, TY, 256, "%128", "%129", "%130", "{%128, %129, %130, %131}", "%132", "%133")

HF_PAGED_MMA64_SHAPES(__half, "f16")
HF_PAGED_MMA64_SHAPES(__nv_bfloat16, "bf16")

#undef HF_PAGED_MMA64_SHAPES
#undef HF_PAGED_MMA64
#undef HF_PAGED_STR_256
#undef HF_PAGED_STR_192
#undef HF_PAGED_STR_160
#undef HF_PAGED_STR_128
#undef HF_PAGED_STR_112
#undef HF_PAGED_STR_96
#undef HF_PAGED_STR_80
#undef HF_PAGED_STR_64
#undef HF_PAGED_STR_32
#undef HF_PAGED_REGS_64_79
#undef HF_PAGED_REGS_48_55
#undef HF_PAGED_REGS_32_47
#undef HF_PAGED_REGS_32_39
#undef HF_PAGED_REGS_0_15
#undef HF_PAGED_REGS_96
#undef HF_PAGED_REGS_64
#undef HF_PAGED_REGS_32
#undef HF_PAGED_REGS_0
#undef HF_PAGED_ACC_256
#undef HF_PAGED_ACC_192
#undef HF_PAGED_ACC_160
#undef HF_PAGED_ACC_128
#undef HF_PAGED_ACC_112
#undef HF_PAGED_ACC_96
#undef HF_PAGED_ACC_80
#undef HF_PAGED_ACC_64
#undef HF_PAGED_ACC_32
#undef HF_PAGED_ACC32
#undef HF_PAGED_ACC8

}  // namespace wgmma
}  // namespace hf_paged
