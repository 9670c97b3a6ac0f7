// KV write: scatter the step's new K/V rows into their cache slots by slot_mapping (-1 = padding, skipped).
//
// Dtype-agnostic: a token's [Hkv, D] row is copied as 16-byte vectors, one vector of K and one of V per thread.
// Both loads are issued before the slot test so that three independent loads are in flight per thread.
#include "launch.h"

namespace hf_paged {
namespace {

constexpr int kWriteThreads = 256;

__global__ void __launch_bounds__(kWriteThreads)
    write_kv_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value, uint4* __restrict__ k_cache,
                    uint4* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int64_t total,
                    int vecs_per_token, int64_t key_stride, int64_t value_stride) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x;
  if (idx >= total) return;
  const int64_t t = idx / vecs_per_token;
  const int i = static_cast<int>(idx - t * vecs_per_token);
  const int64_t slot = __ldg(slot_mapping + t);
  const uint4 k = __ldg(key + t * key_stride + i);
  const uint4 v = __ldg(value + t * value_stride + i);
  if (slot < 0) return;
  k_cache[slot * vecs_per_token + i] = k;
  v_cache[slot * vecs_per_token + i] = v;
}

}  // namespace

cudaError_t launch_write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int64_t num_tokens, int vecs_per_token,
                            int64_t key_row_stride_vecs, int64_t value_row_stride_vecs, cudaStream_t stream) {
  const int64_t total = num_tokens * vecs_per_token;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = (total + kWriteThreads - 1) / kWriteThreads;
  write_kv_kernel<<<static_cast<unsigned>(blocks), kWriteThreads, 0, stream>>>(
      static_cast<const uint4*>(key), static_cast<const uint4*>(value), static_cast<uint4*>(k_cache),
      static_cast<uint4*>(v_cache), slot_mapping, total, vecs_per_token, key_row_stride_vecs, value_row_stride_vecs);
  return cudaGetLastError();
}

}  // namespace hf_paged
