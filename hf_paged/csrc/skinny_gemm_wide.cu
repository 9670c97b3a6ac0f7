// Skinny GEMM for 9 to 64 rows of x (decode at batch 9 to 64): out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), bound
// by streaming the weight; a launch serves up to kSkinnyMaxGroup weights that share x, as skinny_gemm.cu does for up
// to 8 rows.
//
// The weight side is skinny_gemm.cu's: each warp owns a tile of 16 weight rows, filled per 32-wide chunk of K into
// two m16n8k16 A fragments from 16-byte global loads (lane (g, t) loads k = 8t .. 8t + 7 of rows g and g + 8; see
// the permuted k order in that file's header). The x rows, padded up to 8 * NT, are NT n-tiles of 8 columns; each A
// fragment meets all NT of them, so the weight is read once whatever M.
//
// x is not read per warp: at 64 rows that would be 4x the weight's bytes. A block stages its slice of x in shared
// memory with cp.async, kSliceChunks chunks of K at a time in a two-stage ring: stage [chunk][row][32 k] (64 bytes a
// row), so lane (g, t) reads n-tile j's B fragment as 16 bytes at row 8j + g, offset 16t: the same k order as its
// A fragment, and a warp's 32 reads are 512 contiguous bytes (no bank conflicts). A slice is 256 k: a block of 8
// tiles streams 64 KiB of weight per slice against 8 * NT * 512 bytes of x (at most half as much, from L2).
//
// Per slice, each warp issues its first batch of weight loads, then waits for the slice's x and a block barrier
// (which also frees the other stage for the next slice's cp.async), then runs its products. Accumulators: NT x 4
// floats a lane (32 at 64 rows).
//
// Split of K (small N leaves too few tiles to keep the SMs streaming): first across the blocks of a thread-block
// cluster on sm_90 (`cluster`; each block stages only its own part of x), then, only where the launch would still
// leave SMs without a block, across the warps of a block (`parts`, each taking a share of every slice; each such
// split adds the block's x reads again). The partial sums meet in shared memory (the x stages, reused) and, across
// the cluster, in distributed shared memory; each block of a cluster reduces and stores 1 / cluster of the outputs.
// No workspace, no atomics, no host sync: the launch can be captured.
#include <cooperative_groups.h>

#include <algorithm>

#include "skinny_gemm_common.cuh"

namespace hf_paged {
namespace {

namespace cg = cooperative_groups;
using namespace skinny;  // the tiles, loads and stores both skinny kernels share

constexpr int kUnroll = 4;        // chunks of K per batch of weight loads
constexpr int kSliceChunks = 8;   // chunks of K per staged slice of x
constexpr int kStages = 2;

// Bytes of one staged slice of x (8 * nt rows of kSliceChunks chunks): 4 KiB per n-tile.
__host__ __device__ constexpr int stage_bytes(int nt) { return 8 * nt * kSliceChunks * kChunk * 2; }
// Dynamic shared memory: the stages, which then hold the partial sums [warp][n-tile][lane] (float4 each).
__host__ __device__ constexpr int smem_bytes(int nt) { return kStages * stage_bytes(nt); }
static_assert(kWarps * 32 * 16 <= kStages * stage_bytes(1), "the partial sums fit in the x stages");
// Blocks per SM the launch bounds ask registers for (up to 128 a thread): the accumulators, one batch of weight
// loads, its fragments and the addresses need 96 (16 rows) to 124 (64 rows); three blocks (80) spill.
constexpr int kBlocksPerSm = 2;

// How a thread stages x: one 16-byte piece (row, sub) of every chunk it copies, so that its global address is one
// pointer. A stage holds 4 * 8 * NT pieces per chunk; the block's threads cover them kGroups times over, group q
// copying chunks q, q + kGroups, ... of the slice (threads past the last whole group copy nothing: their first chunk
// is kSliceChunks).
template <typename T, int NT>
struct Stager {
  static constexpr int kPieces = 4 * 8 * NT, kGroups = kThreads / kPieces;
  const T* src;      // x + row * x_stride + 8 * sub
  int offset;        // bytes from a stage's start: (first chunk, row, sub)
  int first, sub;    // first chunk of the slice it copies, its 16 bytes in a chunk
  bool row_valid;    // row < M
};

template <typename T, int NT>
__device__ __forceinline__ Stager<T, NT> stager(const SkinnyGemmParams& p) {
  using S = Stager<T, NT>;
  const int piece = threadIdx.x % S::kPieces, row = piece / 4, group = threadIdx.x / S::kPieces;
  const bool valid = row < p.m;
  return {static_cast<const T*>(p.x) + (valid ? row * p.x_stride + 8 * (piece % 4) : 0),
          (group * S::kPieces + piece) * 16, group < S::kGroups ? group : kSliceChunks, piece % 4, valid};
}

// Stage chunks slice .. slice + kSliceChunks of x at `stage`, [chunk][row][32 k]: consecutive threads on consecutive
// shared memory. Rows past M, chunks past this block's `end` and k past K are zeros (nothing read).
template <typename T, int NT>
__device__ __forceinline__ void stage_x(const SkinnyGemmParams& p, const Stager<T, NT>& st, const uint4* stage,
                                        int slice, int end) {
  using S = Stager<T, NT>;
  const uint32_t base = smem_u32(stage) + st.offset;
#pragma unroll
  for (int i = 0; i < (kSliceChunks + S::kGroups - 1) / S::kGroups; ++i) {
    const int chunk = slice + st.first + i * S::kGroups, k = chunk * kChunk + 8 * st.sub;
    if (st.first + i * S::kGroups >= kSliceChunks) break;  // past the slice (groups need not divide it)
    const bool valid = st.row_valid && chunk < end && k < p.k;
    cp_async16(base + i * S::kGroups * S::kPieces * 16, st.src + (valid ? chunk * kChunk : 0), valid);
  }
}

// The weight rows of a lane: g and g + 8 of its tile (rows past N read the last row again; not stored), at 8t.
template <typename T>
struct WeightRows {
  const T* lo;
  const T* hi;
  int k_end;  // this lane's offsets in a chunk must stay below it
};

template <typename T>
__device__ __forceinline__ WeightRows<T> weight_rows(const SkinnyGemmParams& p, const Slice<T>& s, int g, int t) {
  const int row = s.tile * kTileRows + g;
  return {s.weight + static_cast<int64_t>(min(row, s.n - 1)) * p.k + 8 * t,
          s.weight + static_cast<int64_t>(min(row + 8, s.n - 1)) * p.k + 8 * t, p.k - 8 * t};
}

// Chunks c .. c + kUnroll (those below `last`) of the lane's weight rows; zeros elsewhere.
template <typename T>
__device__ __forceinline__ void load_batch(uint4 (&lo)[kUnroll], uint4 (&hi)[kUnroll], const WeightRows<T>& w, int c,
                                           int last) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int k0 = (c + j) * kChunk;
    const bool valid = c + j < last && k0 < w.k_end;
    lo[j] = load_weight(w.lo + k0, valid);
    hi[j] = load_weight(w.hi + k0, valid);
  }
}

// acc[j] += the batch's weight tile . n-tile j of x, for the batch's first `count` chunks; `xs` points at the
// batch's first chunk in its stage.
template <typename T, int NT>
__device__ __forceinline__ void multiply(float (&acc)[NT][4], const uint4 (&lo)[kUnroll], const uint4 (&hi)[kUnroll],
                                         const uint4* xs, int count, int lane) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    if (j >= count) break;  // warp-uniform
    const uint32_t first[4] = {lo[j].x, hi[j].x, lo[j].y, hi[j].y};
    const uint32_t second[4] = {lo[j].z, hi[j].z, lo[j].w, hi[j].w};
    const uint4* row = xs + j * 8 * NT * 4 + lane;  // (chunk j, row g, 16 bytes t): lane = 4g + t
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 b = row[nt * 32];
      Mma<T>::run(acc[nt], first, b.x, b.y);
      Mma<T>::run(acc[nt], second, b.z, b.w);
    }
  }
}

// Sum this block's share of the split partial sums (1 / cluster of the block's outputs: every rank's `parts` warps
// of a tile) and store it.
template <typename T, int NT>
__device__ __forceinline__ void reduce_and_store(const GroupLaunch& l, float4* partial, int parts, int cluster,
                                                 int rank) {
  const int tiles_per_block = kWarps / parts, units = tiles_per_block * NT * 32;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const cg::cluster_group group = cg::this_cluster();
#endif
  for (int u = rank * units / cluster + threadIdx.x; u < (rank + 1) * units / cluster; u += kThreads) {
    const int tile = u / (NT * 32), nt = u / 32 % NT, lane = u % 32;
    Slice<T> s{};
    if (!find_slice(l, blockIdx.x * tiles_per_block + tile, s)) continue;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < cluster; ++r) {
      const float4* from = partial;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (cluster > 1) from = group.map_shared_rank(partial, r);
#endif
      for (int q = 0; q < parts; ++q) add(sum, from[((tile * parts + q) * NT + nt) * 32 + lane]);
    }
    store<T>(l.p, s, sum, 8 * nt, lane / 4, lane % 4);
  }
}

// Grid: (blocks over the group's tiles, cluster); block: kWarps / parts tiles, `parts` warps per tile, each a share
// of every slice of the block's chunks of K. Dynamic shared memory: smem_bytes(NT).
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    skinny_gemm_wide_kernel(const __grid_constant__ GroupLaunch l, int parts, int cluster) {
  extern __shared__ uint4 smem[];
  constexpr int kStageVectors = stage_bytes(NT) / 16;
  const SkinnyGemmParams& p = l.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int part = warp % parts, rank = blockIdx.y;  // grid.y is one cluster: blockIdx.y is the rank in it
  Slice<T> s{};
  const bool owns_tile = find_slice(l, blockIdx.x * (kWarps / parts) + warp / parts, s);
  const WeightRows<T> w = owns_tile ? weight_rows(p, s, g, t) : WeightRows<T>{};
  const int chunks = p.k / kChunk + (p.k % kChunk != 0);  // below 2^26: rank * chunks fits an int
  const int begin = rank * chunks / cluster, end = (rank + 1) * chunks / cluster;
  const int share = kSliceChunks / parts;
  const Stager<T, NT> st = stager<T, NT>(p);
  float acc[NT][4] = {};
  stage_x<T, NT>(p, st, smem, begin, end);
  cp_async_commit();
  for (int slice = begin, i = 0; slice < end; slice += kSliceChunks, ++i) {
    const int first = slice + part * share, last = min(first + share, end);
    uint4 lo[kUnroll], hi[kUnroll];
    if (owns_tile) load_batch(lo, hi, w, first, last);
    cp_async_wait<0>();
    __syncthreads();  // this slice's x is in, and every warp is done with the other stage
    if (slice + kSliceChunks < end)
      stage_x<T, NT>(p, st, smem + (i + 1) % kStages * kStageVectors, slice + kSliceChunks, end);
    cp_async_commit();
    if (!owns_tile) continue;
    const uint4* xs = smem + i % kStages * kStageVectors;
    for (int c = first; c < last; c += kUnroll) {
      if (c > first) load_batch(lo, hi, w, c, last);
      multiply<T, NT>(acc, lo, hi, xs + (c - slice) * 8 * NT * 4, last - c, lane);
    }
  }
  if (parts == 1 && cluster == 1) {
    if (owns_tile) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) store<T>(p, s, acc[nt], 8 * nt, g, t);
    }
    return;
  }
  cp_async_wait<0>();  // (the prologue's zeros when this block has no chunk of K)
  __syncthreads();     // every warp is done with the x stages: they hold the partial sums from here
  float4* partial = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    partial[(warp * NT + nt) * 32 + lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  partials_written(cluster);
  reduce_and_store<T, NT>(l, partial, parts, cluster, rank);
  partials_read(cluster);
}

// Splits of K per tile, parts x cluster (powers of two). Clusters first: the most blocks (at most kMaxCluster, each
// at least one slice of K) that keep the launch one wave of resident blocks. Then parts, only while the launch stays
// within one block per SM (each part reads the block's x again), each warp keeping at least two chunks of K. On an
// H100 (132 SMs, 2 blocks an SM), clusters of Llama-3.1-8B's products: one GPU: q+k+v (384 tiles) 4, o and down
// (256 tiles) 8, gate+up (1792 tiles) 1; a rank of two: q+k+v (192 tiles) 8, o and down 8, gate+up (896 tiles) 2;
// parts 1 in all of them.
void choose_split(const SkinnyGemmParams& p, int64_t tiles, int blocks_per_sm, int& parts, int& cluster) {
  const int64_t chunks = (int64_t{p.k} + kChunk - 1) / kChunk, slices = (chunks + kSliceChunks - 1) / kSliceChunks;
  const int64_t resident = static_cast<int64_t>(p.sms) * blocks_per_sm;
  const auto blocks = [&](int64_t parts, int64_t cluster) { return (tiles * parts + kWarps - 1) / kWarps * cluster; };
  parts = 1, cluster = 1;
  while (p.clusters && cluster * 2 <= kMaxCluster && cluster * 2 <= slices && blocks(1, cluster * 2) <= resident)
    cluster *= 2;
  while (parts * 2 <= kWarps && blocks(parts * 2, cluster) <= p.sms && chunks >= 4 * parts * cluster) parts *= 2;
}

template <typename T, int NT>
cudaError_t launch(const SkinnyGemmParams& p, cudaStream_t stream) {
  const auto kernel = skinny_gemm_wide_kernel<T, NT>;
  int blocks_per_sm = 0;
  const cudaError_t error = prepare(reinterpret_cast<const void*>(kernel), smem_bytes(NT), blocks_per_sm);
  if (error != cudaSuccess) return error;
  const GroupLaunch l = group_launch(p);
  const int64_t tiles = l.tile_begin[p.count];
  int parts = 1, cluster = 1;
  choose_split(p, tiles, blocks_per_sm, parts, cluster);
  const int64_t tiles_per_block = kWarps / parts;
  return launch_clusters(kernel, (tiles + tiles_per_block - 1) / tiles_per_block, cluster, smem_bytes(NT), stream, l,
                         parts, cluster);
}

// The kernel for x's rows padded up to n-tiles of 8.
template <typename T>
cudaError_t launch_rows(const SkinnyGemmParams& p, cudaStream_t stream) {
  switch ((p.m + 7) / 8) {
    case 2: return launch<T, 2>(p, stream);
    case 3: return launch<T, 3>(p, stream);
    case 4: return launch<T, 4>(p, stream);
    case 5: return launch<T, 5>(p, stream);
    case 6: return launch<T, 6>(p, stream);
    case 7: return launch<T, 7>(p, stream);
    case 8: return launch<T, 8>(p, stream);
    default: return cudaErrorInvalidValue;  // the op checks kSkinnyMaxRows < m <= kSkinnyWideMaxRows first
  }
}

}  // namespace

cudaError_t launch_skinny_gemm_wide(const SkinnyGemmParams& p, cudaStream_t stream) {
  return p.bf16 ? launch_rows<__nv_bfloat16>(p, stream) : launch_rows<__half>(p, stream);
}

}  // namespace hf_paged
