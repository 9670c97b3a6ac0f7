// Skinny GEMM for decode: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) with M <= 8, bound by streaming the weight;
// a launch serves up to kSkinnyMaxGroup weights that share x (q/k/v, gate/up), one output each.
//
// Each warp owns a tile of 16 weight rows and a slice of K, and runs it on tensor cores (m16n8k16, weight rows as
// A, the x rows as the 8 columns of B). A dot product does not care in which order k is summed, only that A and B
// use the same order, so the fragments are filled straight from 16-byte global loads with no shared memory and no
// shuffles: per 32-wide chunk of K, lane (g = lane / 4, t = lane % 4) loads k = 8t .. 8t + 7 of weight rows g and
// g + 8 and of x row g. Its four 32-bit words hold k pairs (8t, 8t+1), (8t+2, 8t+3), (8t+4, 8t+5), (8t+6, 8t+7);
// the first mma takes words 0 and 1 as the fragment's k pairs (2t, 2t+1) and (2t+8, 2t+9) (see ptx.cuh), the
// second words 2 and 3: every k of the chunk is met exactly once, in A and B alike. Lane (g, t) ends holding
// out[2t][g], out[2t+1][g], out[2t][g+8], out[2t+1][g+8] of its tile.
//
// A batch of kUnroll chunks (8 weight loads and 4 x loads per lane, 4 KiB of weight per warp) is issued before its
// products. Weight loads bypass L1 (read once) with a 256-byte L2 prefetch (a batch reads 256 contiguous bytes of
// each row); x stays in L1 for the other warps. Rows past N and x rows past M read the last row again (their
// results are not stored); chunk lanes past K or past a slice's end load zeros.
//
// Small N leaves too few tiles to keep every SM streaming, so K is split: across the warps of a block (`parts`,
// reduced in shared memory) and, on sm_90, across the blocks of a thread-block cluster (`cluster`, reduced by rank 0
// reading the other blocks' shared memory). No workspace, no atomics, no host sync: the launch can be captured.
//
// A group of weights is one list of tiles: weight i owns tiles tile_begin[i] .. tile_begin[i + 1) (a prefix sum
// passed by value), and each warp looks its tile's weight up among the at most four ranges (constant indices into
// the kernel's parameters, no local memory). The split of K is chosen for the group's total tile count, so three
// small products (the k/v side of attention) fill the GPU as one larger one does.
#include <cooperative_groups.h>

#include <algorithm>

#include "skinny_gemm_common.cuh"

namespace hf_paged {
namespace {

namespace cg = cooperative_groups;
using namespace skinny;  // the tiles, loads, stores and launch of skinny_gemm_common.cuh

constexpr int kUnroll = 4;        // 32-wide chunks of K per batch
constexpr int kWarpsPerSm = 24;   // resident warps per SM the launch bounds below guarantee

// acc += weight[tile rows, chunks begin .. end) . x[:, same k], in the fragment layout described above.
template <typename T>
__device__ __forceinline__ void accumulate(float (&acc)[4], const SkinnyGemmParams& p, const Slice<T>& s, int begin,
                                           int end, int g, int t) {
  float acc2[4] = {0.f, 0.f, 0.f, 0.f};  // the second mma of each chunk: two dependency chains of half the length
  const int row = s.tile * kTileRows + g;
  const T* lo = s.weight + static_cast<int64_t>(min(row, s.n - 1)) * p.k + 8 * t;
  const T* hi = s.weight + static_cast<int64_t>(min(row + 8, s.n - 1)) * p.k + 8 * t;
  const T* xr = static_cast<const T*>(p.x) + static_cast<int64_t>(min(g, p.m - 1)) * p.x_stride + 8 * t;
  const int lane_k_end = p.k - 8 * t;  // this lane's offsets in a chunk must stay below it
  for (int c = begin; c < end; c += kUnroll) {
    uint4 a_lo[kUnroll], a_hi[kUnroll], b[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int k0 = (c + j) * kChunk;
      const bool valid = c + j < end && k0 < lane_k_end;
      a_lo[j] = load_weight(lo + k0, valid);
      a_hi[j] = load_weight(hi + k0, valid);
      b[j] = valid ? __ldg(reinterpret_cast<const uint4*>(xr + k0)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint32_t first[4] = {a_lo[j].x, a_hi[j].x, a_lo[j].y, a_hi[j].y};
      const uint32_t second[4] = {a_lo[j].z, a_hi[j].z, a_lo[j].w, a_hi[j].w};
      Mma<T>::run(acc, first, b[j].x, b[j].y);
      Mma<T>::run(acc2, second, b[j].z, b[j].w);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += acc2[i];
}

// Grid: (blocks over the group's tiles, cluster); block: kWarps / parts tiles, `parts` warps per tile, each a slice
// of K.
template <typename T>
__global__ void __launch_bounds__(kThreads, kWarpsPerSm / kWarps)
    skinny_gemm_kernel(const __grid_constant__ GroupLaunch l, int parts, int cluster) {
  const SkinnyGemmParams& p = l.p;
  __shared__ float4 partial[kWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int part = warp % parts, rank = blockIdx.y;  // grid.y is one cluster: blockIdx.y is the rank in it
  const int tile = blockIdx.x * (kWarps / parts) + warp / parts;
  Slice<T> s{};
  const bool owns_tile = find_slice(l, tile, s);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (owns_tile) {
    const int64_t chunks = (p.k + kChunk - 1) / kChunk, splits = parts * cluster, split = rank * parts + part;
    accumulate<T>(acc, p, s, static_cast<int>(split * chunks / splits),
                  static_cast<int>((split + 1) * chunks / splits), g, t);
  }
  if (parts == 1 && cluster == 1) {
    if (owns_tile) store<T>(p, s, acc, g, t);
    return;
  }
  partial[warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  partials_written(cluster);
  if (rank == 0 && part == 0 && owns_tile) {
    for (int q = 1; q < parts; ++q) add(acc, partial[warp + q][lane]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int r = 1; r < cluster; ++r) {
      const float4* remote = cg::this_cluster().map_shared_rank(&partial[warp][0], r);
      for (int q = 0; q < parts; ++q) add(acc, remote[q * 32 + lane]);
    }
#endif
    store<T>(p, s, acc, g, t);
  }
  partials_read(cluster);  // rank 0 has read every block's partial sums
}

// Splits of K per tile (a power of two, parts x cluster): the most that keep every warp of the launch resident at
// once (one wave: for the small matrices every weight byte is requested at the start), at least two chunks of K per
// warp, at most kWarps per block times kMaxCluster blocks. On an H100 (132 SMs): lm_head 1, gate/up 8192 x 2048 4,
// q/o 2048 x 2048 and down 2048 x 8192 16, k/v 512 x 2048 32 (8 warps x clusters of 4 blocks); the 1B model's
// q+k+v (192 tiles) 16, its gate+up (1024 tiles) 2.
void choose_split(const SkinnyGemmParams& p, int64_t tiles, int& parts, int& cluster) {
  const int64_t chunks = (p.k + kChunk - 1) / kChunk;
  const int64_t resident = static_cast<int64_t>(p.sms) * kWarpsPerSm;
  const int64_t most = std::min<int64_t>(std::max<int64_t>(1, chunks / 2), p.clusters ? kWarps * kMaxCluster : kWarps);
  int64_t splits = 1;
  while (splits * 2 <= most && tiles * splits * 2 <= resident) splits *= 2;
  parts = static_cast<int>(std::min<int64_t>(splits, kWarps));
  cluster = static_cast<int>(splits / parts);
}

template <typename T>
cudaError_t launch(const SkinnyGemmParams& p, cudaStream_t stream) {
  const GroupLaunch l = group_launch(p);
  const int64_t tiles = l.tile_begin[p.count];
  int parts = 1, cluster = 1;
  choose_split(p, tiles, parts, cluster);
  const int64_t tiles_per_block = kWarps / parts;
  return launch_clusters(skinny_gemm_kernel<T>, (tiles + tiles_per_block - 1) / tiles_per_block, cluster, stream, l,
                         parts, cluster);
}

}  // namespace

cudaError_t launch_skinny_gemm(const SkinnyGemmParams& p, cudaStream_t stream) {
  return p.bf16 ? launch<__nv_bfloat16>(p, stream) : launch<__half>(p, stream);
}

}  // namespace hf_paged
