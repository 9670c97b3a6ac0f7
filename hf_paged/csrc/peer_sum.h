// The one-shot sum over the ranks of a tensor-parallel group (peer_sum.cu), for the small all-reduces of decode
// steps. Every rank holds one symmetric buffer (the same size on each rank, mapped into every peer's address space by
// torch's symmetric memory) laid out as:
//
//   [ data half 0 | data half 1 | flags: uint64 [kPeerSumBlocks][kPeerSumMaxRanks] | epochs: uint64 [kPeerSumBlocks] ]
//
// A call copies this rank's input into the data half of the call's parity, tells every peer "block b of rank r has
// written epoch e" in the peer's flags, waits for the same word from each peer in its own flags, then sums the
// inputs of all ranks in rank order (float accumulation, so every rank computes the bit-identical result).
//
// The fused forms add a residual to the sum (rounded to the dtype first, as the unfused layer does) and may follow it
// with an RMSNorm of each row; the norm's blocks take whole rows (row r to block r % kPeerSumBlocks on every rank), so
// a block sums the squares of its own rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

constexpr int kPeerSumMaxRanks = 8;
// A fixed grid: block b of every call handles the same 16-byte units on every rank and counts its own epochs, so
// a block's epoch is the number of calls so far on every rank.
constexpr int kPeerSumBlocks = 64;
constexpr int kPeerSumThreads = 512;

// Bytes after the two data halves: the flags and the epochs. A buffer of B bytes has halves of
// (B - kPeerSumControlBytes) / 2 rounded down to 16 bytes.
constexpr int64_t kPeerSumControlBytes =
    static_cast<int64_t>(kPeerSumBlocks) * (kPeerSumMaxRanks + 1) * static_cast<int64_t>(sizeof(uint64_t));

struct PeerSumArgs {
  const void* in;                // this rank's input, n16 16-byte units
  void* out;                     // the sum, n16 units (plus `residual` where given)
  int64_t n16;
  const uint64_t* buffers;       // device array: the base address of each rank's buffer, as this rank maps it
  int64_t half_bytes;            // bytes of one data half (a multiple of 16); the flags start at 2 * half_bytes
  int rank, world_size;
  uint64_t timeout_ns;           // how long a block waits for a peer before it traps (0: forever)
  // The fused forms (a decoder layer's all-reduce, residual add and RMSNorm in one kernel):
  const void* residual;          // null, or n16 units added to the sum (out = T(residual + T(sum)))
  const void* weight;            // null, or the norm's weight, row_units units: norm_out = T(weight * T(out * rstd))
  void* norm_out;                // n16 units, where weight is given
  int row_units;                 // units per row (hidden size * element size / 16), where weight is given
  float eps;                     // the norm's epsilon: rstd = rsqrt(mean(out^2) + eps) in float32
};

// The rows of a fused norm a block holds in registers: row_units <= kPeerSumThreads * kPeerSumMaxRowUnitsPerThread
// (hidden 16384 in bf16).
constexpr int kPeerSumMaxRowUnitsPerThread = 4;

// dtype: 0 float32, 1 float16, 2 bfloat16.
cudaError_t launch_peer_sum(const PeerSumArgs& args, int dtype, cudaStream_t stream);

}  // namespace hf_paged
