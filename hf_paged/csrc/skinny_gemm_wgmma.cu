// Skinny GEMM on Hopper's warpgroup products (wgmma), for 1 to 64 rows of x: out[M, N] = x[M, K] @ weight[N, K]^T
// (+ bias), one launch for up to kSkinnyMaxGroup weights that share x. Built for sm_90a only: kernels/build.py
// defines HF_PAGED_SM90A with that target; any other build compiles the stub at the end, and the op refuses.
//
// Why: at 16 to 64 rows a decode step's products are still bound by the weight's bytes, but the mma.sync kernel
// (skinny_gemm_wide.cu) spends as much time issuing products as streaming, and cuBLAS reaches 50-85% of copy
// bandwidth on a tensor-parallel rank's shapes (docs/skinny_gemm_wide_h100_2026-11-27.json). A wgmma takes the
// products off the issue path: one instruction multiplies 64 weight rows by all of x's rows.
//
// The product, transposed: the weight is wgmma's A (M = 64 weight rows per warpgroup), x its B (N = x's rows,
// padded to kRows = 32 or 64 with zeros), both K-major in 128-byte-swizzled shared memory (wgmma.cuh's layout, one
// 64-wide panel per stage). The accumulator of warp w of a warpgroup holds weight rows 16w..16w+15 against every x
// row, laid out as mma.sync C fragments (wgmma.cuh), so skinny::store writes it as the other skinny kernels do.
//
// A block: 256 threads, two warpgroups, kBlockRows = 128 weight rows (a tile; a tile never spans two weights of the
// group). Per step of K (kPanels 64-wide panels: 1 by default, 2 with HF_PAGED_SKINNY_WGMMA_PANELS=2, read per
// launch, a tuning switch) it stages 16 KiB of weight and kRows * 128 bytes of x per panel with cp.async, kStages
// steps deep (4 at one panel: two blocks an SM; 3 at two: one), and issues four m64nNk16 products per panel and
// warpgroup on the oldest stage. x is read again by every tile (from L2): 1/4 (32 rows) to 1/2 (64 rows) of the
// weight's bytes.
//
// Split of K: across the blocks of a thread-block cluster (clusters of up to 8 along grid y, each rank a contiguous
// share of the steps), sized so that the launch's clusters are resident at once (cudaOccupancyMaxActiveClusters:
// a cluster's blocks share one GPC, so fewer clusters of 8 fit than SMs / 8 suggests). Each rank leaves its fp32
// partial sums in its shared memory (the stages, reused); after a cluster barrier each rank sums 1 / cluster of the
// tile's outputs over every rank's partials through distributed shared memory, adds the bias and stores. No
// workspace, no atomics, no host sync: the launch can be captured.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "skinny_gemm.h"

#ifdef HF_PAGED_SM90A
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "skinny_gemm_common.cuh"
#include "wgmma.cuh"

namespace hf_paged {
namespace {

namespace cg = cooperative_groups;
using namespace skinny;  // kThreads (256), the group's slices, the weight-tile store, the cluster launch

constexpr int kBlockRows = 128;  // weight rows per block: two warpgroups of 64
constexpr int kPanelK = 64;      // K per 128-byte swizzle panel

// x's rows padded to kRows (32 or 64), kPanels panels of K per stage.
template <int kRows, int kPanels>
struct Layout {
  static constexpr int kStepK = kPanelK * kPanels, kStages = kPanels == 1 ? 4 : 3;
  static constexpr int kWeightStageBytes = kBlockRows * kStepK * 2;  // 16 KiB a panel: [panel][128 rows][64 k]
  static constexpr int kXStageBytes = kRows * kStepK * 2;            // [panel][kRows][64 k]
  static constexpr int kStageBytes = kWeightStageBytes + kXStageBytes;  // weight panels, then x's (1024-aligned)
  // The partial sums after the main loop: [warp][n-tile][lane] float4, in the stages.
  static constexpr int kPartialBytes = kWarps * (kRows / 8) * 32 * 16;
  static_assert(kPartialBytes <= kStages * kStageBytes, "the partial sums fit in the stages");
  static_assert(kXStageBytes % 1024 == 0, "each panel starts on a 1024-byte boundary");
  // + up to 1008 bytes to align the base: dynamic shared memory is only 16-byte aligned.
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
};

// Stage step `step` of K: the tile's 128 weight rows (rows past N zeros) and x's rows (rows past M zeros), k past K
// zeros; nothing read for the zeros. 16-byte pieces, swizzled (wgmma::sw128_offset, chunk c of a row in panel c / 8):
// 4 * kPanels weight pieces and kPanels * kRows / 32 x pieces per thread, consecutive threads on consecutive 16-byte
// chunks of a row (128 * kPanels bytes of it in one go).
template <typename T, int kRows, int kPanels>
__device__ __forceinline__ void stage_step(const SkinnyGemmParams& p, const Slice<T>& s, uint32_t stage, int step) {
  using L = Layout<kRows, kPanels>;
  constexpr int kChunks = 8 * kPanels;  // 16-byte chunks of a row per step
  const int k0 = step * L::kStepK;
#pragma unroll
  for (int i = 0; i < kBlockRows * kChunks / kThreads; ++i) {
    const int piece = i * kThreads + threadIdx.x, row = piece / kChunks, chunk = piece % kChunks;
    const int n = s.tile * kBlockRows + row, k = k0 + 8 * chunk;
    const bool valid = n < s.n && k < p.k;
    cp_async16(stage + wgmma::sw128_offset<kBlockRows>(row, chunk),
               s.weight + (valid ? static_cast<int64_t>(n) * p.k + k : 0), valid);
  }
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int i = 0; i < (kRows * kChunks + kThreads - 1) / kThreads; ++i) {
    const int piece = i * kThreads + threadIdx.x, row = piece / kChunks, chunk = piece % kChunks;
    if (piece >= kRows * kChunks) break;
    const int k = k0 + 8 * chunk;
    const bool valid = row < p.m && k < p.k;
    cp_async16(stage + L::kWeightStageBytes + wgmma::sw128_offset<kRows>(row, chunk),
               x + (valid ? row * p.x_stride + k : 0), valid);
  }
}

// acc += the warpgroup's 64 weight rows of `stage` . x's rows, over the stage's K (four k16 products a panel).
template <typename T, int kRows, int kPanels>
__device__ __forceinline__ void multiply(float (&acc)[kRows / 2], uint32_t stage, int warpgroup) {
  using L = Layout<kRows, kPanels>;
  const uint32_t a = stage + warpgroup * 64 * 128, b = stage + L::kWeightStageBytes;
  wgmma::fence_operands(acc);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < L::kStepK / 16; ++kk) {  // panel kk / 4; a k16 step is 32 bytes into each 128-byte row
    const uint32_t panel = kk / 4, col = kk % 4 * 32;
    wgmma::Mma64<T, kRows>::ss(acc, wgmma::sw128_desc(a + panel * kBlockRows * 128 + col, 16, 1024),
                               wgmma::sw128_desc(b + panel * kRows * 128 + col, 16, 1024), 1);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(acc);
}

// Grid: (tiles, cluster); the cluster's blocks along y, blockIdx.y its rank, each a share of K's steps.
template <typename T, int kRows, int kPanels>
__global__ void __launch_bounds__(kThreads, 2) skinny_gemm_wgmma_kernel(const __grid_constant__ GroupLaunch l,
                                                                        int cluster) {
  using L = Layout<kRows, kPanels>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw);
  const SkinnyGemmParams& p = l.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, rank = blockIdx.y;
  Slice<T> s{};
  const bool owns_tile = find_slice(l, blockIdx.x, s);  // (uniform over the block: false only past the last tile)
  const int steps = (p.k + L::kStepK - 1) / L::kStepK;
  const int begin = static_cast<int>(static_cast<int64_t>(rank) * steps / cluster);
  const int end = static_cast<int>(static_cast<int64_t>(rank + 1) * steps / cluster);
  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  if (owns_tile) {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (begin + i < end) stage_step<T, kRows, kPanels>(p, s, base + i * L::kStageBytes, begin + i);
      cp_async_commit();  // (empty groups keep the count uniform)
    }
    for (int step = begin, i = 0; step < end; ++step, ++i) {
      cp_async_wait<kStages - 2>();  // this thread's pieces of step `step` are in
      wgmma::fence_proxy_async();    // written through cp.async, read next by wgmma
      __syncthreads();               // everyone's pieces; and every product of step - 1 is done with its stage
      if (step + kStages - 1 < end)
        stage_step<T, kRows, kPanels>(p, s, base + (i + kStages - 1) % kStages * L::kStageBytes, step + kStages - 1);
      cp_async_commit();
      multiply<T, kRows, kPanels>(acc, base + i % kStages * L::kStageBytes, warp / 4);
    }
  }
  const int g = lane / 4, t = lane % 4;
  Slice<T> rows = s;  // the warp's 16 weight rows, as skinny::store counts tiles (of 16 rows)
  rows.tile = s.tile * (kBlockRows / 16) + warp;
  if (cluster == 1) {
    if (owns_tile) {
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j) {
        const float part[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
        store<T>(p, rows, part, 8 * j, g, t);
      }
    }
    return;
  }
  cp_async_wait<0>();
  __syncthreads();  // every product is done with the stages: they hold the partial sums from here
  float4* partial = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j)
    partial[(warp * (kRows / 8) + j) * 32 + lane] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                                                                 acc[4 * j + 3]);
  const cg::cluster_group group = cg::this_cluster();
  group.sync();
  constexpr int kUnits = kWarps * (kRows / 8) * 32;
  if (owns_tile) {
    for (int u = rank * kUnits / cluster + static_cast<int>(threadIdx.x); u < (rank + 1) * kUnits / cluster;
         u += kThreads) {
      const int w = u / ((kRows / 8) * 32), j = u / 32 % (kRows / 8), ln = u % 32;
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < cluster; ++r) add(sum, group.map_shared_rank(partial, r)[u]);
      Slice<T> unit = s;
      unit.tile = s.tile * (kBlockRows / 16) + w;
      store<T>(p, unit, sum, 8 * j, ln / 4, ln % 4);
    }
  }
  group.sync();  // keep this block's partials alive until every rank has read them
}

// How many clusters of `cluster` blocks of `kernel` can be resident at once on the current device (asked once per
// device, kernel and size; 0 where the query fails: that size is then not taken).
int resident_clusters(const void* kernel, int smem, int cluster) {
  static std::mutex mu;
  static std::map<std::pair<std::pair<int, const void*>, int>, int> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(std::make_pair(device, kernel), cluster);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1, static_cast<unsigned>(cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1, attribute[0].val.clusterDim.y = cluster, attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int count = 0;
  if (cudaOccupancyMaxActiveClusters(&count, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // a refused size is no error of the launch
    count = 0;
  }
  return known[key] = count;
}

// The cluster (split of K): the largest power of two up to kMaxCluster whose clusters (one per tile) are all resident
// at once and that gives each rank at least two steps of K; 1 where none is. On an H100 (132 SMs, two blocks an SM
// at 64 rows) a rank of two of Llama-3.1-8B has 24 tiles (q+k+v), 32 (o, down), 56 (gate or up), 112 (gate+up).
int choose_cluster(const SkinnyGemmParams& p, const void* kernel, int smem, int64_t tiles, int blocks_per_sm,
                   int step_k) {
  const int64_t steps = (int64_t{p.k} + step_k - 1) / step_k;
  if (!p.clusters) return 1;
  for (int cluster = kMaxCluster; cluster > 1; cluster /= 2) {
    if (2 * cluster > steps || tiles * cluster > int64_t{p.sms} * blocks_per_sm) continue;
    if (tiles <= resident_clusters(kernel, smem, cluster)) return cluster;
  }
  return 1;
}

template <typename T, int kRows, int kPanels>
cudaError_t launch(const SkinnyGemmParams& p, cudaStream_t stream) {
  const auto kernel = skinny_gemm_wgmma_kernel<T, kRows, kPanels>;
  constexpr int smem = Layout<kRows, kPanels>::kSmemBytes;
  int blocks_per_sm = 0;
  const cudaError_t error = prepare(reinterpret_cast<const void*>(kernel), smem, blocks_per_sm);
  if (error != cudaSuccess) return error;
  const GroupLaunch l = group_launch(p, kBlockRows);  // tiles of 128 rows
  const int64_t tiles = l.tile_begin[p.count];
  const int cluster = choose_cluster(p, reinterpret_cast<const void*>(kernel), smem, tiles, blocks_per_sm,
                                     Layout<kRows, kPanels>::kStepK);
  return launch_clusters(kernel, tiles, cluster, smem, stream, l, cluster);
}

// HF_PAGED_SKINNY_WGMMA_PANELS=2: two panels (128 k) a step; anything else one. Read per launch (a tuning switch
// for benchmarks/skinny_gemm.py; a captured graph keeps the choice of its capture).
bool two_panels() {
  const char* value = std::getenv("HF_PAGED_SKINNY_WGMMA_PANELS");
  return value != nullptr && std::strcmp(value, "2") == 0;
}

template <typename T, int kRows>
cudaError_t launch_panels(const SkinnyGemmParams& p, cudaStream_t stream) {
  return two_panels() ? launch<T, kRows, 2>(p, stream) : launch<T, kRows, 1>(p, stream);
}

template <typename T>
cudaError_t launch_rows(const SkinnyGemmParams& p, cudaStream_t stream) {
  if (p.m <= 32) return launch_panels<T, 32>(p, stream);
  if (p.m <= 64) return launch_panels<T, 64>(p, stream);
  return cudaErrorInvalidValue;  // the op checks 1 <= m <= kSkinnyWideMaxRows first
}

}  // namespace

bool skinny_gemm_wgmma_built() { return true; }

cudaError_t launch_skinny_gemm_wgmma(const SkinnyGemmParams& p, cudaStream_t stream) {
  return p.bf16 ? launch_rows<__nv_bfloat16>(p, stream) : launch_rows<__half>(p, stream);
}

}  // namespace hf_paged

#else  // not an sm_90a build: the op refuses before launching

namespace hf_paged {

bool skinny_gemm_wgmma_built() { return false; }

cudaError_t launch_skinny_gemm_wgmma(const SkinnyGemmParams&, cudaStream_t) { return cudaErrorNotSupported; }

}  // namespace hf_paged

#endif
