// The pieces of the skinny-GEMM kernel (skinny_gemm.cu) apart from its main loop: the group's list of weight tiles,
// the weight loads that fill an m16n8k16 A fragment straight from global memory, the store of one 16 x 8 accumulator
// tile, the barriers around the split-K partial sums, and the launch in thread-block clusters.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "ptx.cuh"
#include "skinny_gemm.h"
#include "vec.cuh"

namespace hf_paged {
namespace skinny {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kTileRows = 16;     // weight rows per warp (the mma's m)
constexpr int kChunk = 32;        // k per chunk: 4 lanes x 8 elements
constexpr int kMaxCluster = 8;    // the portable cluster size

// The kernel's argument: the ops' parameters and the first tile of each weight (tile_begin[count] = all tiles).
struct GroupLaunch {
  SkinnyGemmParams p;
  int tile_begin[kSkinnyMaxGroup + 1];
};

inline GroupLaunch group_launch(const SkinnyGemmParams& p) {
  GroupLaunch l{};
  l.p = p;
  for (int i = 0; i < p.count; ++i) l.tile_begin[i + 1] = l.tile_begin[i] + (p.n[i] + kTileRows - 1) / kTileRows;
  for (int i = p.count + 1; i <= kSkinnyMaxGroup; ++i) l.tile_begin[i] = l.tile_begin[p.count];
  return l;
}

// One warp's tile: the weight it reads, where it writes, and its tile's index within that weight.
template <typename T>
struct Slice {
  const T* weight;
  const T* bias;
  T* out;
  int n, tile;
};

// The slice of global tile `tile`; false past the last weight's tiles.
template <typename T>
__device__ __forceinline__ bool find_slice(const GroupLaunch& l, int tile, Slice<T>& s) {
  bool found = false;
#pragma unroll
  for (int i = 0; i < kSkinnyMaxGroup; ++i) {
    if (i < l.p.count && tile >= l.tile_begin[i] && tile < l.tile_begin[i + 1]) {
      s.weight = static_cast<const T*>(l.p.weight[i]), s.bias = static_cast<const T*>(l.p.bias[i]);
      s.out = static_cast<T*>(l.p.out[i]), s.n = l.p.n[i], s.tile = tile - l.tile_begin[i];
      found = true;
    }
  }
  return found;
}

// 16 bytes of the weight (read once: no L1 allocation, a 256-byte L2 prefetch), zeros where !valid (nothing read).
__device__ __forceinline__ uint4 load_weight(const void* p, bool valid) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  asm volatile(
      "{\n .reg .pred v;\n setp.ne.b32 v, %5, 0;\n"
      " @v ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(valid)));
  return r;
}

// One accumulator tile of lane (g, t): weight rows g and g + 8 of the slice's tile, x rows 2t and 2t + 1. Bias added
// in fp32, rounded once; only rows below N and x rows below M are written.
template <typename T>
__device__ __forceinline__ void store(const SkinnyGemmParams& p, const Slice<T>& s, const float (&acc)[4], int g,
                                      int t) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int n = s.tile * kTileRows + g + 8 * half;
    if (n >= s.n) continue;
    const float b = s.bias != nullptr ? to_float(s.bias[n]) : 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int m = 2 * t + i;
      if (m < p.m) s.out[static_cast<int64_t>(m) * s.n + n] = from_float<T>(acc[2 * half + i] + b);
    }
  }
}

__device__ __forceinline__ void add(float (&acc)[4], const float4& v) {
  acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
}

// Before the split partial sums are read: a barrier over the cluster where K is split across its blocks (a block
// barrier too), else over the block.
__device__ __forceinline__ void partials_written(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) cooperative_groups::this_cluster().sync();
  else __syncthreads();
#else
  __syncthreads();  // cluster is 1 below sm_90 (the host never asks for more)
#endif
}

// After them: keep every block's shared memory alive until the cluster's other blocks have read it.
__device__ __forceinline__ void partials_read(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) cooperative_groups::this_cluster().sync();
#endif
}

// `kernel` on a grid of (blocks, cluster) blocks of kThreads, the cluster's blocks along y (blockIdx.y is the rank).
template <typename Kernel, typename... Args>
cudaError_t launch_clusters(Kernel kernel, int64_t blocks, int cluster, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(cluster));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1, attribute[0].val.clusterDim.y = cluster, attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace skinny
}  // namespace hf_paged
