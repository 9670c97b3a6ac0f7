// Host side of paged varlen prefill: argument checks, tile-configuration choice, launch (a cache in the query's
// dtype, or an e4m3 cache with its per-kv-head scales). Registers
// torch.ops.hf_paged.paged_prefill as a fragment of the library that ops.cpp defines.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "checks.h"
#include "ops.h"
#include "paged_prefill.cuh"

namespace hf_paged {
namespace {

bool is_wgmma(int64_t config) { return config == kPrefillConfigWgmma || config == kPrefillConfigWgmmaSerial; }

PrefillKernel select_prefill(at::ScalarType dtype, bool e4m3_cache, int64_t head_dim, int64_t config) {
  if (head_dim > 1 << 16) return PrefillKernel{};
  const int d = static_cast<int>(head_dim), c = static_cast<int>(config);
  if (is_wgmma(config)) {
    const bool pipelined = config == kPrefillConfigWgmma;
    switch (e4m3_cache ? at::kFloat : dtype) {
      case at::kHalf: return prefill_kernel_wgmma_f16(d, pipelined);
      case at::kBFloat16: return prefill_kernel_wgmma_bf16(d, pipelined);
      default: return PrefillKernel{};
    }
  }
  if (config < 0 || config >= kPrefillConfigs) return PrefillKernel{};
  if (e4m3_cache) {
    switch (dtype) {
      case at::kHalf: return prefill_kernel_f16_e4m3(d, c);
      case at::kBFloat16: return prefill_kernel_bf16_e4m3(d, c);
      default: return PrefillKernel{};
    }
  }
  const bool wide = d >= kPrefillWideHeadDim;
  switch (dtype) {
    case at::kHalf: return wide ? prefill_kernel_f16_wide(d, c) : prefill_kernel_f16(d, c);
    case at::kBFloat16: return wide ? prefill_kernel_bf16_wide(d, c) : prefill_kernel_bf16(d, c);
    default: return PrefillKernel{};
  }
}

int smem_optin(int device) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return optin;
}

// Measured on H200: 4 warps x 32 rows (config 0) is 20% faster than the 16-row-per-warp
// tiles from 2k tokens up and even at 16 x 512; 64-row tiles (config 1) only where 128-row tiles cannot fill the SMs.
// Above head_dim 128 config 0 is not compiled (registers); 8 warps x 16 rows (config 2) keeps its 128-row tiles.
// A tile whose K/V stages exceed the card's shared memory (head_dim 256 on cards below ~200 KB) drops to config 1.
int64_t auto_config(at::ScalarType dtype, bool e4m3_cache, int device, int64_t batch, int64_t heads,
                    int64_t head_dim, int64_t max_seqlen_q) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t ctas_128 = batch * heads * ((max_seqlen_q + 127) / 128);
  if (ctas_128 < sms) return 1;
  const int64_t config = head_dim > 128 ? 2 : 0;
  return select_prefill(dtype, e4m3_cache, head_dim, config).smem_bytes <= smem_optin(device) ? config : 1;
}

// Kernels above 48 KB of shared memory must opt in, once per (device, kernel).
void allow_smem(const PrefillKernel& k, int device) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  const std::lock_guard<std::mutex> lock(mu);
  if (done.insert({device, k.fn}).second)
    C10_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes));
}

// What prefill checks beyond the shared query / cache / table checks.
void check_prefill_args(const at::Tensor& query, const at::Tensor& cu_seqlens_q, const at::Tensor& block_tables,
                        const AttentionShape& s, int64_t batch) {
  check_cuda_tensor(cu_seqlens_q, "cu_seqlens_q", query.device());
  TORCH_CHECK_VALUE(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.dim() == 1 &&
                        cu_seqlens_q.numel() == batch + 1 && cu_seqlens_q.is_contiguous(),
                    "cu_seqlens_q must be a contiguous int32 [batch + 1] tensor");
  TORCH_CHECK_VALUE(s.heads <= 65535, "paged_prefill takes at most 65535 heads");
  TORCH_CHECK_VALUE(s.rows < (int64_t{1} << 31) && block_tables.size(1) * s.block_size < (int64_t{1} << 31),
                    "token counts and block-table capacity must fit in int32");
}

// The Hopper kernels (is_wgmma configs): compiled for this dtype and head size, in this build, and run on a
// compute capability 9.0 device. Nothing falls back silently: a caller asked for this kernel by name.
void check_wgmma(const at::Tensor& query, bool e4m3, int64_t head_dim, int64_t config) {
  bool served_head_dim = false;  // keep in step with paged_prefill_wgmma_<dtype>.cu's select_head_dim lists
  for (const int64_t d : {32, 64, 80, 96, 112, 128, 160, 192, 256}) served_head_dim |= head_dim == d;
  TORCH_CHECK_NOT_IMPLEMENTED(!e4m3 && (query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16) &&
                                  served_head_dim,
                              format("the wgmma prefill serves float16/bfloat16 over a cache of the same dtype with "
                                     "head_dim 32, 64, 80, 96, 112, 128, 160, 192 or 256; got %s%s with head_dim %lld",
                                     c10::toString(query.scalar_type()), e4m3 ? " over a float8_e4m3fn cache" : "",
                                     (long long)head_dim));
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, query.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, query.get_device()));
  TORCH_CHECK_NOT_IMPLEMENTED(major == 9 && minor == 0,
                              format("the wgmma prefill runs on compute capability 9.0 (Hopper) only, this GPU is "
                                     "%d.%d; use config -1", major, minor));
  TORCH_CHECK_NOT_IMPLEMENTED(select_prefill(query.scalar_type(), false, head_dim, config).fn != nullptr,
                              "the wgmma prefill is not in this build (built for sm_90a only: HF_PAGED_SM90A)");
}

}  // namespace

int64_t paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                      int64_t max_seqlen_q, double scale, int64_t config, int64_t window, double softcap,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const AttentionShape s = check_query_and_cache(out, query, k_cache, v_cache, "num_tokens", /*allow_e4m3=*/true);
  check_kv_scales(k_cache, k_scale, v_scale, query.device());
  const bool e4m3 = is_e4m3(k_cache);
  const int64_t batch = seq_lens_k.numel();
  check_lengths_and_tables(seq_lens_k, "seq_lens_k", block_tables, batch, query.device());
  check_prefill_args(query, cu_seqlens_q, block_tables, s, batch);
  const float scale_log2 = softmax_scale_log2(scale);
  const ScoreOptions options = score_options(window, softcap, scale);
  const int64_t heads = s.heads, head_dim = s.head_dim, kv_heads = s.kv_heads, bs = s.block_size;
  TORCH_CHECK_VALUE(config == kPrefillConfigAuto || is_wgmma(config) || (config >= 0 && config < kPrefillConfigs),
                    format("config must be -1 (auto), a tile configuration index below %d, or %d / %d (wgmma, "
                           "Hopper)", (int)kPrefillConfigs, (int)kPrefillConfigWgmma, (int)kPrefillConfigWgmmaSerial));
  const c10::cuda::CUDAGuard guard(query.device());
  if (is_wgmma(config)) check_wgmma(query, e4m3, head_dim, config);
  TORCH_CHECK_NOT_IMPLEMENTED(!e4m3 || select_prefill(query.scalar_type(), true, head_dim, 1).fn != nullptr,
                              format("paged_prefill serves a float8_e4m3fn cache with float16/bfloat16 queries and "
                                     "head_dim 64, 128 or 256; got %s with head_dim %lld",
                                     c10::toString(query.scalar_type()), (long long)head_dim));
  if (query.scalar_type() == at::kFloat) {  // CUDA cores: each row a decode over the keys it sees (decode_ops.cpp)
    paged_prefill_f32(out, query, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale_log2, options, s);
    return kPrefillConfigAuto;
  }
  // Compiled at all? (asked with config 1, compiled for every head size, before any device call)
  TORCH_CHECK_NOT_IMPLEMENTED(select_prefill(query.scalar_type(), false, head_dim, 1).fn != nullptr,
                              format("paged_prefill serves float16/bfloat16/float32 with head_dim 32, 64, 80, 96, 112, "
                                     "128, 160, 192 or 256; got %s with head_dim %lld",
                                     c10::toString(query.scalar_type()), (long long)head_dim));
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0");
  const int device = query.get_device();
  if (config == kPrefillConfigAuto)
    config = auto_config(query.scalar_type(), e4m3, device, batch, heads, head_dim, max_seqlen_q);
  const PrefillKernel k = select_prefill(query.scalar_type(), e4m3, head_dim, config);
  TORCH_CHECK_NOT_IMPLEMENTED(k.fn != nullptr, format("tile configuration %lld (32 rows per warp) is compiled up to "
                                                      "head_dim 128, not %lld; use 1, 2 or -1 (auto)",
                                                      (long long)config, (long long)head_dim));
  TORCH_CHECK_NOT_IMPLEMENTED(k.smem_bytes <= smem_optin(device),
                              format("tile configuration %lld at head_dim %lld needs %d bytes of shared memory, this "
                                     "GPU allows %d per block; use config 1 or -1 (auto)", (long long)config,
                                     (long long)head_dim, k.smem_bytes, smem_optin(device)));
  if (batch == 0 || max_seqlen_q == 0 || query.size(0) == 0) return config;
  allow_smem(k, device);

  PrefillParams p{};
  p.out = out.data_ptr(), p.query = query.data_ptr(), p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>(), p.seq_lens_k = seq_lens_k.data_ptr<int32_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.q_stride_t = query.stride(0), p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0), p.o_stride_h = out.stride(1);
  p.num_kv_heads = static_cast<int>(kv_heads), p.group_size = static_cast<int>(heads / kv_heads);
  p.block_size = static_cast<int>(bs), p.block_shift = block_shift_of(bs);
  p.table_stride = static_cast<int>(block_tables.stride(0));
  p.max_context = static_cast<int>(block_tables.size(1) * bs);
  p.scale_log2 = scale_log2;
  p.window = options.window, p.softcap = options.softcap, p.softcap_inv = options.softcap_inv;
  if (e4m3) p.k_scale = k_scale->data_ptr<float>(), p.v_scale = v_scale->data_ptr<float>();
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
        "Tensor seq_lens_k, Tensor block_tables, int max_seqlen_q, float scale, int config, int window=0, "
        "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None) -> int");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) { m.impl("paged_prefill", &hf_paged::paged_prefill); }
