// Host-side argument checks shared by the torch ops (declared in checks.h).
#include "checks.h"
#include "launch.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <utility>

namespace hf_paged {

namespace {
constexpr double kLog2e = 1.4426950408889634;  // the only copy: kernels receive scale * log2(e) ready-made
}  // namespace

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return std::string(buf);
}

std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.is_cuda(), format("%s must be a CUDA tensor, got one on %s", name, t.device().str().c_str()));
  TORCH_CHECK_VALUE(t.device() == device, format("%s is on %s but the other tensors are on %s", name,
                                                 t.device().str().c_str(), device.str().c_str()));
}

int vec_elems(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 4;
    case at::kHalf:
    case at::kBFloat16: return 8;
    default: return 0;
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

bool is_e4m3(const at::Tensor& cache) { return cache.scalar_type() == at::kFloat8_e4m3fn; }

void check_kv_scales(const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, const at::Device& device) {
  if (!is_e4m3(k_cache)) {
    TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                      format("k_scale and v_scale dequantize a float8_e4m3fn cache; this cache is %s: pass None",
                             c10::toString(k_cache.scalar_type())));
    return;
  }
  TORCH_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(),
                    "a float8_e4m3fn cache needs its k_scale and v_scale (float32 [num_kv_heads] each)");
  const int64_t kv_heads = k_cache.size(2);
  for (const auto& [t, name] : {std::pair{&*k_scale, "k_scale"}, std::pair{&*v_scale, "v_scale"}}) {
    check_cuda_tensor(*t, name, device);
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == kv_heads && t->is_contiguous(),
                      format("%s must be a contiguous float32 [num_kv_heads] tensor ([%lld]), got %s %s", name,
                             static_cast<long long>(kv_heads), c10::toString(t->scalar_type()),
                             shape_of(*t).c_str()));
  }
}

AttentionShape check_query_and_cache(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const char* query_dims, bool allow_e4m3) {
  const at::Device device = query.device();
  check_cuda_tensor(query, "query", device), check_cuda_tensor(out, "out", device);
  check_cuda_tensor(k_cache, "k_cache", device), check_cuda_tensor(v_cache, "v_cache", device);
  TORCH_CHECK_VALUE(query.dim() == 3, format("query must be [%s, num_heads, head_dim], got %s", query_dims,
                                             shape_of(query).c_str()));
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous(),
                    format("k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] "
                           "tensors of one shape, got %s and %s", shape_of(k_cache).c_str(),
                           shape_of(v_cache).c_str()));
  const AttentionShape s{query.size(0), query.size(1), k_cache.size(2), query.size(2), k_cache.size(1)};
  TORCH_CHECK_VALUE(k_cache.size(3) == s.head_dim, format("query head_dim %lld != cache head_dim %lld",
                                                          static_cast<long long>(s.head_dim),
                                                          static_cast<long long>(k_cache.size(3))));
  TORCH_CHECK_VALUE(s.kv_heads > 0 && s.heads % s.kv_heads == 0,
                    format("num_heads (%lld) must be a multiple of num_kv_heads (%lld)",
                           static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads)));
  const auto dtype = query.scalar_type(), kv_dtype = k_cache.scalar_type();
  const bool e4m3_cache = allow_e4m3 && is_e4m3(k_cache);
  TORCH_CHECK_VALUE((kv_dtype == dtype || e4m3_cache) && v_cache.scalar_type() == kv_dtype &&
                        out.scalar_type() == dtype,
                    format("query, out and the caches must share one dtype%s, got %s, %s and %s / %s",
                           allow_e4m3 ? " (or both caches be float8_e4m3fn)" : "", c10::toString(dtype),
                           c10::toString(out.scalar_type()), c10::toString(kv_dtype),
                           c10::toString(v_cache.scalar_type())));
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), format("out must be shaped like query %s", shape_of(query).c_str()));
  const int64_t vec = vec_elems(dtype);
  for (const at::Tensor* t : {&query, &out}) {
    // A dimension of size 1 may carry any stride (compiled code leaves them so); the kernels never step along it.
    TORCH_CHECK_VALUE(vec > 0 && t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) % vec == 0) &&
                          (t->size(0) == 1 || t->stride(0) % vec == 0) && aligned16(*t),
                      "query and out rows must be contiguous and 16-byte aligned; call .contiguous() first");
  }
  TORCH_CHECK_VALUE(aligned16(k_cache) && aligned16(v_cache), "k_cache and v_cache must be 16-byte aligned");
  TORCH_CHECK_VALUE(k_cache.size(0) * k_cache.size(1) <= INT32_MAX, "the cache holds more than 2^31 token slots");
  return s;
}

void check_lengths_and_tables(const at::Tensor& lens, const char* lens_name, const at::Tensor& block_tables,
                              int64_t batch, const at::Device& device) {
  check_cuda_tensor(lens, lens_name, device), check_cuda_tensor(block_tables, "block_tables", device);
  TORCH_CHECK_VALUE(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.size(0) == batch && lens.is_contiguous(),
                    format("%s must be a contiguous int32 [batch] tensor (batch %lld), got %s %s", lens_name,
                           static_cast<long long>(batch), c10::toString(lens.scalar_type()),
                           shape_of(lens).c_str()));
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                        block_tables.size(0) == batch && block_tables.stride(1) == 1,
                    "block_tables must be an int32 [batch, max_blocks] tensor with contiguous rows");
  TORCH_CHECK_VALUE(batch <= 65535, format("at most 65535 sequences per launch, got %lld",
                                           static_cast<long long>(batch)));
}

float softmax_scale_log2(double scale) {
  TORCH_CHECK_VALUE(scale > 0.0, format("scale must be positive, got %g", scale));
  return static_cast<float>(scale * kLog2e);
}

ScoreOptions score_options(int64_t window, double softcap, double scale) {
  ScoreOptions o{kNoWindow, 0.f, 0.f};
  if (window > 0) o.window = static_cast<int>(std::min<int64_t>(window, kNoWindow));
  if (softcap > 0.0) {
    o.softcap = static_cast<float>(softcap / scale);
    o.softcap_inv = static_cast<float>(scale / softcap);
  }
  return o;
}

int64_t keys_read(int64_t max_seq_len, int64_t window) {
  return window > 0 ? std::min(max_seq_len, window) : max_seq_len;
}

int block_shift_of(int64_t block_size) {
  return (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(block_size)) : -1;
}

}  // namespace hf_paged
