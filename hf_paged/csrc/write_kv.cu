// KV write: scatter the step's new K/V rows into their cache slots by slot_mapping (-1 = padding, skipped).
//
// Dtype-agnostic: a token's [Hkv, D] row is copied as 16-byte vectors, two vectors of K and two of V per thread.
// The loads are issued before the slot test so that six independent loads are in flight per thread.
#include "launch.h"

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

}  // namespace

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
