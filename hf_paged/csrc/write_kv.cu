// KV write: scatter the step's new K/V rows into their cache slots by slot_mapping (-1 = padding, skipped).
//
// Dtype-agnostic: a token's [Hkv, D] row is copied as 16-byte vectors, two vectors of K and two of V per thread.
// The loads are issued before the slot test so that six independent loads are in flight per thread.
//
// The e4m3 write (a float8_e4m3fn cache, K/V in float32, fp16 or bf16) quantizes 8 elements per thread with its head's
// scale, after a first launch that sets the scales still unset (one CTA per head of K and of V; a head whose scale
// is set returns at once, so after the first write of a cache that launch costs only its start).
#include "fp8.cuh"
#include "launch.h"
#include "vec.cuh"

namespace hf_paged {
namespace {

constexpr int kWriteThreads = 256;

__global__ void __launch_bounds__(kWriteThreads)
    write_kv_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value, uint4* __restrict__ k_cache,
                    uint4* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int64_t total,
                    int vecs_per_token, int64_t key_stride, int64_t value_stride) {
  // Each thread moves vectors idx and idx + half of the flattened [T, vecs_per_token] grid (one wave of CTAs on
  // an H100/H200 for 4096 tokens of 8 x 128 bf16), all six loads issued before the first store.
  const int64_t half = (total + 1) / 2;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x;
  if (first >= half) return;
  // With an odd total the last thread's second vector repeats its first: the same bytes to the same slot.
  const int64_t at[2] = {first, first + half < total ? first + half : first};
  int64_t slot[2], dst[2];
  uint4 k[2], v[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t t = at[j] / vecs_per_token;
    const int64_t i = at[j] - t * vecs_per_token;
    slot[j] = __ldg(slot_mapping + t);
    dst[j] = i;
    k[j] = __ldg(key + t * key_stride + i);
    v[j] = __ldg(value + t * value_stride + i);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (slot[j] < 0) continue;
    k_cache[slot[j] * vecs_per_token + dst[j]] = k[j];
    v_cache[slot[j] * vecs_per_token + dst[j]] = v[j];
  }
}

constexpr int kScaleThreads = 256;

// 8 elements of a K/V row as float (16-byte aligned: one vector of fp16 / bf16, two of float32).
template <typename T>
__device__ __forceinline__ void load8(const T* src, float (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 8 / Elem<T>::kVec; ++j)
    Elem<T>::unpack(__ldg(reinterpret_cast<const uint4*>(src) + j), f + j * Elem<T>::kVec);
}

// Grid (Hkv, 2): head blockIdx.x of K (y = 0) or V (y = 1). A scale still 0 becomes absmax * 4 / 448 over the
// head's elements in rows with a slot (0 again if one of them is NaN or infinite), as kv_quant.fix_unset_scales.
template <typename T>
__global__ void __launch_bounds__(kScaleThreads)
    fix_scales_kernel(const T* __restrict__ key, const T* __restrict__ value, float* k_scale, float* v_scale,
                      const int64_t* __restrict__ slot_mapping, int64_t num_tokens, int head_dim, int64_t key_stride,
                      int64_t value_stride) {
  const int head = blockIdx.x;
  float* scale = (blockIdx.y ? v_scale : k_scale) + head;
  if (*scale > 0.f) return;  // the same answer for the whole CTA
  const T* x = (blockIdx.y ? value : key) + static_cast<int64_t>(head) * head_dim;
  const int64_t stride = blockIdx.y ? value_stride : key_stride;
  const int groups = head_dim / 8;
  float absmax = 0.f;
  bool finite = true;
  for (int64_t i = threadIdx.x; i < num_tokens * groups; i += kScaleThreads) {
    const int64_t t = i / groups;
    if (__ldg(slot_mapping + t) < 0) continue;
    float f[8];
    load8(x + t * stride + (i - t * groups) * 8, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) finite &= isfinite(f[e]), absmax = fmaxf(absmax, fabsf(f[e]));
  }
  __shared__ float block_max[kScaleThreads / 32];
  __shared__ int block_finite[kScaleThreads / 32];
  for (int off = 16; off > 0; off /= 2) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, off));
  finite = __all_sync(0xffffffffu, finite);
  if ((threadIdx.x & 31) == 0) block_max[threadIdx.x / 32] = absmax, block_finite[threadIdx.x / 32] = finite;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kScaleThreads / 32; ++w) absmax = fmaxf(absmax, block_max[w]), finite &= block_finite[w];
    *scale = finite ? absmax * kScaleHeadroom : 0.f;
  }
}

// One thread per 8 elements of a row (flattened [T, Hkv * D / 8]): K and V quantized into their slot.
template <typename T>
__global__ void __launch_bounds__(kWriteThreads)
    write_kv_e4m3_kernel(const T* __restrict__ key, const T* __restrict__ value, uint2* __restrict__ k_cache,
                         uint2* __restrict__ v_cache, const float* __restrict__ k_scale,
                         const float* __restrict__ v_scale, const int64_t* __restrict__ slot_mapping, int64_t total,
                         int groups_per_token, int groups_per_head, int64_t key_stride, int64_t value_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t t = i / groups_per_token;
  const int group = static_cast<int>(i - t * groups_per_token);
  const int64_t slot = __ldg(slot_mapping + t);
  if (slot < 0) return;
  const int head = group / groups_per_head;
  const T* src[2] = {key + t * key_stride + group * 8, value + t * value_stride + group * 8};
  const float* scales[2] = {k_scale, v_scale};
  uint2* dst[2] = {k_cache, v_cache};
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    float f[8];
    load8(src[kv], f);
    const float s = scales[kv][head];
    const float divisor = s > 0.f ? s : 1.f;  // an unset scale (a head written as NaN) divides by 1
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = quantize_e4m3x2(f[2 * e], f[2 * e + 1], divisor);
    dst[kv][slot * groups_per_token + group] = make_uint2(packed[0] | (packed[1] << 16), packed[2] | (packed[3] << 16));
  }
}

template <typename T>
cudaError_t launch_e4m3(const T* key, const T* value, void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                        const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads, int head_dim,
                        int64_t key_stride, int64_t value_stride, cudaStream_t stream) {
  fix_scales_kernel<T><<<dim3(num_kv_heads, 2), kScaleThreads, 0, stream>>>(
      key, value, k_scale, v_scale, slot_mapping, num_tokens, head_dim, key_stride, value_stride);
  const int groups = num_kv_heads * head_dim / 8;
  const int64_t total = num_tokens * groups;
  write_kv_e4m3_kernel<T><<<static_cast<unsigned>((total + kWriteThreads - 1) / kWriteThreads), kWriteThreads, 0,
                            stream>>>(key, value, static_cast<uint2*>(k_cache), static_cast<uint2*>(v_cache), k_scale,
                                      v_scale, slot_mapping, total, groups, head_dim / 8, key_stride, value_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_write_kv_e4m3(KvSource source, const void* key, const void* value, void* k_cache, void* v_cache,
                                 float* k_scale, float* v_scale, const int64_t* slot_mapping, int64_t num_tokens,
                                 int num_kv_heads, int head_dim, int64_t key_row_stride, int64_t value_row_stride,
                                 cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (source) {
    case KvSource::kFloat:
      return launch_e4m3(static_cast<const float*>(key), static_cast<const float*>(value), k_cache, v_cache, k_scale,
                         v_scale, slot_mapping, num_tokens, num_kv_heads, head_dim, key_row_stride, value_row_stride,
                         stream);
    case KvSource::kHalf:
      return launch_e4m3(static_cast<const __half*>(key), static_cast<const __half*>(value), k_cache, v_cache,
                         k_scale, v_scale, slot_mapping, num_tokens, num_kv_heads, head_dim, key_row_stride,
                         value_row_stride, stream);
    case KvSource::kBFloat16:
      return launch_e4m3(static_cast<const __nv_bfloat16*>(key), static_cast<const __nv_bfloat16*>(value), k_cache,
                         v_cache, k_scale, v_scale, slot_mapping, num_tokens, num_kv_heads, head_dim, key_row_stride,
                         value_row_stride, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int64_t num_tokens, int vecs_per_token,
                            int64_t key_row_stride_vecs, int64_t value_row_stride_vecs, cudaStream_t stream) {
  const int64_t total = num_tokens * vecs_per_token;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = ((total + 1) / 2 + kWriteThreads - 1) / kWriteThreads;
  write_kv_kernel<<<static_cast<unsigned>(blocks), kWriteThreads, 0, stream>>>(
      static_cast<const uint4*>(key), static_cast<const uint4*>(value), static_cast<uint4*>(k_cache),
      static_cast<uint4*>(v_cache), slot_mapping, total, vecs_per_token, key_row_stride_vecs, value_row_stride_vecs);
  return cudaGetLastError();
}

}  // namespace hf_paged
