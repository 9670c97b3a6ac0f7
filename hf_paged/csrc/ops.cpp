// Registers torch.ops.hf_paged.{paged_decode, paged_decode_split_len, write_kv} and holds the KV-write op.
#include "ops.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <utility>

#include "checks.h"
#include "launch.h"

namespace hf_paged {

namespace {

KvSource kv_source(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return KvSource::kFloat;
    case at::kHalf: return KvSource::kHalf;
    case at::kBFloat16: return KvSource::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, format("a float8_e4m3fn cache is written from float32, float16 or bfloat16 key/value, "
                                      "got %s", c10::toString(dtype)));
  }
  return KvSource::kFloat;  // not reached
}

// The quantizing write into float8_e4m3fn caches (key / value rows already checked for shape and layout).
void write_kv_e4m3(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK_VALUE(key.scalar_type() == value.scalar_type(),
                    format("key and value must share one dtype, got %s and %s", c10::toString(key.scalar_type()),
                           c10::toString(value.scalar_type())));
  const KvSource source = kv_source(key.scalar_type());
  TORCH_CHECK_VALUE(key.size(2) % 8 == 0, format("a float8_e4m3fn cache needs head_dim a multiple of 8, got %lld",
                                                 static_cast<long long>(key.size(2))));
  C10_CUDA_CHECK(launch_write_kv_e4m3(source, key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                      k_scale.data_ptr<float>(), v_scale.data_ptr<float>(),
                                      slot_mapping.data_ptr<int64_t>(), key.size(0), static_cast<int>(key.size(1)),
                                      static_cast<int>(key.size(2)), key.stride(0), value.stride(0),
                                      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale) {
  const at::Device device = k_cache.device();
  check_cuda_tensor(key, "key", device), check_cuda_tensor(value, "value", device);
  check_cuda_tensor(v_cache, "v_cache", device), check_cuda_tensor(slot_mapping, "slot_mapping", device);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    format("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got %s "
                           "and %s", shape_of(k_cache).c_str(), shape_of(v_cache).c_str()));
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) &&
                        key.size(2) == k_cache.size(3),
                    format("key and value must be [num_tokens, num_kv_heads, head_dim] matching the cache %s, got %s "
                           "and %s", shape_of(k_cache).c_str(), shape_of(key).c_str(), shape_of(value).c_str()));
  const auto dtype = k_cache.scalar_type();
  check_kv_scales(k_cache, k_scale, v_scale, device);
  TORCH_CHECK_VALUE((is_e4m3(k_cache) || (key.scalar_type() == dtype && value.scalar_type() == dtype)) &&
                        v_cache.scalar_type() == dtype,
                    format("key, value and the caches must share one dtype (or the caches be float8_e4m3fn), got "
                           "%s, %s and %s / %s", c10::toString(key.scalar_type()),
                           c10::toString(value.scalar_type()), c10::toString(dtype),
                           c10::toString(v_cache.scalar_type())));
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                        slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  const int64_t row = key.size(1) * key.size(2), esize = key.element_size();
  TORCH_CHECK_VALUE(row * esize % 16 == 0, "num_kv_heads * head_dim * itemsize must be a multiple of 16 bytes");
  TORCH_CHECK_VALUE(aligned16(k_cache) && aligned16(v_cache), "k_cache and v_cache must be 16-byte aligned");
  for (const at::Tensor* t : {&key, &value}) {
    // A dimension of size 1 may carry any stride (compiled code leaves them so, e.g. one KV head per rank).
    TORCH_CHECK_VALUE(t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2)) &&
                          (t->size(0) == 1 || (t->stride(0) * esize) % 16 == 0) && aligned16(*t),
                      "key/value rows must be contiguous [num_kv_heads, head_dim] blocks at 16-byte aligned "
                      "addresses; call .contiguous() first");
  }
  const c10::cuda::CUDAGuard guard(device);
  if (is_e4m3(k_cache)) return write_kv_e4m3(key, value, k_cache, v_cache, slot_mapping, *k_scale, *v_scale);
  const int vecs = static_cast<int>(row * esize / 16);
  C10_CUDA_CHECK(launch_write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 slot_mapping.data_ptr<int64_t>(), key.size(0), vecs, key.stride(0) * esize / 16,
                                 value.stride(0) * esize / 16, c10::cuda::getCurrentCUDAStream()));
}

void advance_decode(at::Tensor seq_lens, at::Tensor cu_seqlens_k, at::Tensor position, const at::Tensor& slot_of,
                    at::Tensor slot_mapping) {
  const at::Device device = seq_lens.device();
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&seq_lens, "seq_lens"},
                                {&cu_seqlens_k, "cu_seqlens_k"}, {&position, "position"}, {&slot_of, "slot_of"},
                                {&slot_mapping, "slot_mapping"}}) {
    check_cuda_tensor(*t, name, device);
  }
  const int64_t rows = seq_lens.numel();
  TORCH_CHECK_VALUE(seq_lens.scalar_type() == at::kInt && cu_seqlens_k.scalar_type() == at::kInt &&
                        seq_lens.dim() == 1 && cu_seqlens_k.dim() == 1 && cu_seqlens_k.size(0) == rows + 1 &&
                        seq_lens.is_contiguous() && cu_seqlens_k.is_contiguous(),
                    "seq_lens must be a contiguous int32 [B] tensor and cu_seqlens_k int32 [B + 1]");
  TORCH_CHECK_VALUE(position.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                        position.numel() == rows && slot_mapping.numel() == rows && position.is_contiguous() &&
                        slot_mapping.is_contiguous(),
                    "position and slot_mapping must be contiguous int64 tensors of B elements");
  TORCH_CHECK_VALUE(slot_of.scalar_type() == at::kLong && slot_of.dim() == 2 && slot_of.size(0) == rows &&
                        slot_of.stride(1) == 1 && rows <= INT32_MAX,
                    "slot_of must be an int64 [B, positions] tensor with contiguous rows");
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_advance_decode(seq_lens.data_ptr<int32_t>(), cu_seqlens_k.data_ptr<int32_t>(),
                                       position.data_ptr<int64_t>(), slot_of.data_ptr<int64_t>(),
                                       slot_mapping.data_ptr<int64_t>(), static_cast<int>(rows), slot_of.stride(0),
                                       c10::cuda::getCurrentCUDAStream()));
}

}  // namespace hf_paged

TORCH_LIBRARY(hf_paged, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int max_seq_len, float scale, int split_len, Tensor? workspace=None, int window=0, "
        "float softcap=0.0, Tensor(b!)? counters=None, Tensor? k_scale=None, Tensor? v_scale=None, bool pdl=True) "
        "-> int");
  m.def("paged_decode_split_len(Tensor query, Tensor k_cache, int max_seq_len, int window=0) -> int");
  m.def("decode_trace_buffer(Tensor? buffer) -> int", &hf_paged::decode_trace_buffer);  // any device, or None
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def("advance_decode(Tensor(a!) seq_lens, Tensor(b!) cu_seqlens_k, Tensor(c!) position, Tensor slot_of, "
        "Tensor(d!) slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("paged_decode", &hf_paged::paged_decode);
  m.impl("paged_decode_split_len", &hf_paged::paged_decode_split_len);
  m.impl("write_kv", &hf_paged::write_kv);
  m.impl("advance_decode", &hf_paged::advance_decode);
}
