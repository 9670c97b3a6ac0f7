// Host side of paged varlen prefill: argument checks, tile-configuration choice, launch. Registers
// torch.ops.hf_paged.paged_prefill as a fragment of the library that ops.cpp defines.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "ops.h"
#include "paged_prefill.cuh"

namespace hf_paged {
namespace {

PrefillKernel select_prefill(at::ScalarType dtype, int64_t head_dim, int64_t config, bool alibi) {
  if (head_dim > 1 << 16 || config < 0 || config >= kPrefillConfigs) return PrefillKernel{};
  switch (dtype) {
    case at::kHalf: return prefill_kernel_f16(static_cast<int>(head_dim), static_cast<int>(config), alibi);
    case at::kBFloat16: return prefill_kernel_bf16(static_cast<int>(head_dim), static_cast<int>(config), alibi);
    default: return PrefillKernel{};
  }
}

// Measured on H200 (docs/kernels.md, prefill): 4 warps x 32 rows (config 0) is 20% faster than the 16-row-per-warp
// tiles from 2k tokens up and even at 16 x 512; 64-row tiles (config 1) only where 128-row tiles cannot fill the SMs.
int64_t auto_config(int device, int64_t batch, int64_t heads, int64_t max_seqlen_q) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t ctas_128 = batch * heads * ((max_seqlen_q + 127) / 128);
  return ctas_128 < sms ? 1 : 0;
}

// Kernels above 48 KB of shared memory must opt in, once per (device, kernel).
void allow_smem(const PrefillKernel& k, int device) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  const std::lock_guard<std::mutex> lock(mu);
  if (done.insert({device, k.fn}).second)
    C10_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes));
}

void check_prefill_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
                        const at::Tensor& block_tables, const std::optional<at::Tensor>& alibi, double scale) {
  const at::Device device = query.device();
  check_cuda_tensor(query, "query", device), check_cuda_tensor(out, "out", device);
  check_cuda_tensor(k_cache, "k_cache", device), check_cuda_tensor(v_cache, "v_cache", device);
  check_cuda_tensor(cu_seqlens_q, "cu_seqlens_q", device), check_cuda_tensor(seq_lens_k, "seq_lens_k", device);
  check_cuda_tensor(block_tables, "block_tables", device);
  TORCH_CHECK_VALUE(query.dim() == 3,
                    format("query must be [num_tokens, num_heads, head_dim], got %s", shape_of(query).c_str()));
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous(),
                    format("k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] "
                           "tensors of one shape, got %s and %s", shape_of(k_cache).c_str(), shape_of(v_cache).c_str()));
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), head_dim = query.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, format("query head_dim %lld != cache head_dim %lld",
                                                        (long long)head_dim, (long long)k_cache.size(3)));
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0,
                    format("num_heads (%lld) must be a multiple of num_kv_heads (%lld)", (long long)heads,
                           (long long)kv_heads));
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
                    format("query, out and the caches must share one dtype, got %s, %s and %s",
                           c10::toString(dtype), c10::toString(out.scalar_type()),
                           c10::toString(k_cache.scalar_type())));
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), format("out must be shaped like query %s", shape_of(query).c_str()));
  for (const at::Tensor* t : {&query, &out}) {
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) % 8 == 0 && t->stride(0) % 8 == 0 && aligned16(*t),
                      "query and out rows must be contiguous and 16-byte aligned; call .contiguous() first");
  }
  TORCH_CHECK_VALUE(aligned16(k_cache) && aligned16(v_cache), "k_cache and v_cache must be 16-byte aligned");
  const int64_t batch = seq_lens_k.numel();
  TORCH_CHECK_VALUE(seq_lens_k.scalar_type() == at::kInt && seq_lens_k.dim() == 1 && seq_lens_k.is_contiguous(),
                    "seq_lens_k must be a contiguous int32 [batch] tensor");
  TORCH_CHECK_VALUE(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.dim() == 1 &&
                        cu_seqlens_q.numel() == batch + 1 && cu_seqlens_q.is_contiguous(),
                    "cu_seqlens_q must be a contiguous int32 [batch + 1] tensor");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                        block_tables.size(0) == batch && block_tables.stride(1) == 1,
                    "block_tables must be an int32 [batch, max_blocks] tensor with contiguous rows");
  TORCH_CHECK_VALUE(batch <= 65535 && heads <= 65535, "paged_prefill takes at most 65535 sequences and heads");
  TORCH_CHECK_VALUE(scale > 0.0, format("scale must be positive, got %g", scale));
  TORCH_CHECK_VALUE(query.size(0) < (int64_t{1} << 31) && block_tables.size(1) * k_cache.size(1) < (int64_t{1} << 31) &&
                        k_cache.size(0) * k_cache.size(1) < (int64_t{1} << 31),
                    "token counts and cache slots must fit in int32");
  check_alibi_slopes(alibi, heads, device);
}

}  // namespace

int64_t paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                      int64_t max_seqlen_q, double scale, const std::optional<at::Tensor>& alibi_slopes,
                      int64_t config) {
  check_prefill_args(out, query, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, alibi_slopes, scale);
  const int64_t batch = seq_lens_k.numel(), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = k_cache.size(2), bs = k_cache.size(1);
  const bool alibi = alibi_slopes.has_value();
  // Compiled at all? (asked with config 0, before any device call)
  TORCH_CHECK_NOT_IMPLEMENTED(select_prefill(query.scalar_type(), head_dim, 0, alibi).fn != nullptr,
                              format("paged_prefill serves float16/bfloat16 with head_dim 64 or 128; got %s with "
                                     "head_dim %lld", c10::toString(query.scalar_type()), (long long)head_dim));
  TORCH_CHECK_VALUE(config == kPrefillConfigAuto || (config >= 0 && config < kPrefillConfigs),
                    format("config must be -1 (auto) or a tile configuration index below %d", (int)kPrefillConfigs));
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0");
  const c10::cuda::CUDAGuard guard(query.device());
  if (config == kPrefillConfigAuto) config = auto_config(query.get_device(), batch, heads, max_seqlen_q);
  const PrefillKernel k = select_prefill(query.scalar_type(), head_dim, config, alibi);
  if (batch == 0 || max_seqlen_q == 0 || query.size(0) == 0) return config;
  allow_smem(k, query.get_device());

  PrefillParams p{};
  p.out = out.data_ptr(), p.query = query.data_ptr(), p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>(), p.seq_lens_k = seq_lens_k.data_ptr<int32_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.alibi_slopes = alibi ? alibi_slopes->data_ptr<float>() : nullptr;
  p.q_stride_t = query.stride(0), p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0), p.o_stride_h = out.stride(1);
  p.num_kv_heads = static_cast<int>(kv_heads), p.group_size = static_cast<int>(heads / kv_heads);
  p.block_size = static_cast<int>(bs), p.block_shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(bs) : -1;
  p.table_stride = static_cast<int>(block_tables.stride(0));
  p.max_context = static_cast<int>(block_tables.size(1) * bs);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.alibi_log2 = 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>((max_seqlen_q + k.block_m - 1) / k.block_m), static_cast<unsigned>(heads),
                  static_cast<unsigned>(batch));
  void* args[] = {&p};
  C10_CUDA_CHECK(cudaLaunchKernel(k.fn, grid, dim3(k.threads), args, k.smem_bytes,
                                  c10::cuda::getCurrentCUDAStream()));
  return config;
}

}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor seq_lens_k, Tensor block_tables, int max_seqlen_q, float scale, Tensor? alibi_slopes, "
        "int config) -> int");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) { m.impl("paged_prefill", &hf_paged::paged_prefill); }
