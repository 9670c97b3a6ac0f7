// One warp step of the tensor-core decode over an e4m3 tile: the K and V operands are built in registers from the
// fp8 bytes (no ldmatrix: it moves 16-bit elements), in orders chosen so that each lane reads whole chunks.
//
// QK^T: lane (g, t) supplies B column g (token g of n-tile 0, g + 8 of n-tile 1) at the k-slots of k_slot_dim<true>:
//   the 16-byte chunks t, t + 4, ... of the token's row, 4 dims per k-step (Q's fragments use the same order).
// PV: lane (g, t) supplies B rows 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1), the tokens of P's A fragment, at B column g of
//   every n-tile. Which output dim an n-tile column stands for is ours to choose: column g of n-tile nd is dim
//   fp8_out_dim(nd, g) = (g + 8 (nd / 8)) * 8 + nd % 8, so a lane reads 8 consecutive bytes of each of its 4 token
//   rows per 8 n-tiles, and the accumulator columns are put back in order when the warp's state is stored.
#pragma once

#include "paged_decode_mma.cuh"

namespace hf_paged {
namespace decode {

__device__ __forceinline__ int fp8_out_dim(int nd, int col) { return (col + 8 * (nd >> 3)) * 8 + (nd & 7); }

// S = Q K^T over an e4m3 tile (unscaled: the CTA's scale_log2 carries the kv head's K scale).
template <typename T, int D>
__device__ __forceinline__ void fp8_tile_qk(uint32_t k_tile, int lane, const uint32_t (&qa)[D / 16][4],
                                           float (&s)[2][4]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int i = 0; i < D / 64; ++i) {
      uint4 c;
      const uint32_t addr = fp8_chunk<D>(k_tile, g + 8 * j, t + 4 * i);
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(c.x), "=r"(c.y), "=r"(c.z), "=r"(c.w)
                   : "r"(addr));
      const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
      for (int u = 0; u < 4; ++u)  // k-step 4i + u: dims 4u, 4u+1 in k-slots 2t, 2t+1; 4u+2, 4u+3 in 2t+8, 2t+9
        Mma<T>::run(s[j], qa[4 * i + u], e4m3x2_to<T>(words[u]), e4m3x2_to<T>(words[u] >> 16));
    }
  }
}

// O += P V over an e4m3 tile; `pa` is P as the A fragment (tokens in the natural order of the tile).
template <typename T, int D>
__device__ __forceinline__ void fp8_tile_pv(uint32_t v_tile, int lane, const uint32_t (&pa)[4], float (&o)[D / 8][4]) {
  const int g = lane >> 2, t = lane & 3;
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
  for (int piece = 0; piece < D / 64; ++piece) {  // 8 bytes of each row: n-tiles 8 piece .. 8 piece + 7
    uint32_t r[4][2];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t addr = fp8_chunk<D>(v_tile, rows[k], (g >> 1) + 4 * piece) + (g & 1) * 8;
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r[k][0]), "=r"(r[k][1]) : "r"(addr));
    }
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
      for (int b = 0; b < 4; b += 2) {
        // Bytes b, b+1 of rows (2t, 2t+1) -> pairs for n-tiles nd, nd + 1; the same for rows (2t+8, 2t+9).
        const uint32_t sel = b | ((b + 4) << 4) | ((b + 1) << 8) | ((b + 5) << 12);
        const uint32_t lo = __byte_perm(r[0][w], r[1][w], sel), hi = __byte_perm(r[2][w], r[3][w], sel);
        const int nd = 8 * piece + 4 * w + b;
        Mma<T>::run(o[nd], pa, e4m3x2_to<T>(lo), e4m3x2_to<T>(hi));
        Mma<T>::run(o[nd + 1], pa, e4m3x2_to<T>(lo >> 16), e4m3x2_to<T>(hi >> 16));
      }
  }
}

}  // namespace decode
}  // namespace hf_paged
