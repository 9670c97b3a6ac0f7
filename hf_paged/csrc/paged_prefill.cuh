// Plain C++ interface between the prefill op (prefill_ops.cpp) and the prefill kernels (paged_prefill_*.cu).
// No torch and no device code here, so the host file includes it cheaply.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

// One paged varlen prefill launch. T packed new tokens of B sequences, H query heads, Hkv kv heads, D head_dim.
// Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and a context of seq_lens_k[b] tokens whose last
// q_len tokens are its new ones (bottom-right causal alignment): new token i sits at position seq_len - q_len + i.
struct PrefillParams {
  void* out;                    // [T, H, D] query dtype; strides o_stride_t / o_stride_h, last dim contiguous
  const void* query;            // [T, H, D] strides q_stride_t / q_stride_h, last dim contiguous
  const void* k_cache;          // [num_blocks, block_size, Hkv, D], contiguous: query dtype, or e4m3
  const void* v_cache;          // same
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* seq_lens_k;    // [B] context length, new tokens included
  const int32_t* block_tables;  // [B, table_stride]; entries past a sequence's length are never read
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;  // elements
  int num_kv_heads, group_size;
  int block_size, block_shift;  // block_shift = log2(block_size), or -1 when block_size is not a power of two
  int table_stride;
  int max_context;              // table_stride * block_size: longer seq_lens are clamped (memory safety)
  float scale_log2;             // softmax scale * log2(e): the kernel exponentiates in base 2
  int window;                   // new token at position i sees keys j with i - window < j <= i (kNoWindow: all)
  float softcap, softcap_inv;   // as in DecodeParams (launch.h): the cap in units of q.k, 0 = off; its inverse
  // An e4m3 cache's float32 [Hkv] scales (value = fp8 * scale); nullptr for a cache in the query's dtype.
  const float* k_scale;
  const float* v_scale;
};

// Tile shapes compiled per (dtype, head_dim). kPrefillConfigAuto lets the host pick.
//   0: 4 warps x 32 query rows (BLOCK_M 128)   1: 4 warps x 16 rows (BLOCK_M 64)   2: 8 warps x 16 rows (BLOCK_M 128)
constexpr int kPrefillConfigs = 3;
constexpr int kPrefillConfigAuto = -1;

struct PrefillKernel {
  const void* fn = nullptr;  // __global__ void(PrefillParams); nullptr when not compiled
  int threads = 0;
  int block_m = 0;           // query rows per CTA
  int smem_bytes = 0;        // dynamic shared memory
};

// Head sizes 32, 64, 80, 96 (paged_prefill_<dtype>.cu) and 112, 128, 160, 192, 256 (paged_prefill_<dtype>_wide.cu):
// two files per dtype, so that ninja builds the 24 kernels of each dtype on four cores. Config 0 is compiled up to
// head_dim 128. A shape that is not compiled returns fn == nullptr.
constexpr int kPrefillWideHeadDim = 112;  // from here on, the _wide files
PrefillKernel prefill_kernel_f16(int head_dim, int config);
PrefillKernel prefill_kernel_bf16(int head_dim, int config);
PrefillKernel prefill_kernel_f16_wide(int head_dim, int config);
PrefillKernel prefill_kernel_bf16_wide(int head_dim, int config);
// Over an e4m3 (float8_e4m3fn) cache, fp16 / bf16 queries: head sizes 64, 128 and 256 (the decode's), every config
// compiled for them (paged_prefill_<dtype>_e4m3.cu).
PrefillKernel prefill_kernel_f16_e4m3(int head_dim, int config);
PrefillKernel prefill_kernel_bf16_e4m3(int head_dim, int config);

// Hopper's warpgroup tensor cores (wgmma, paged_prefill_wgmma*.cuh), chosen by the cuda backend, not by auto: config
// kPrefillConfigWgmma (softmax overlapped with the tensor cores inside each warpgroup) or kPrefillConfigWgmmaSerial
// (each product waited for before the softmax). fp16 / bf16 over a cache in the query's dtype, head sizes 32, 64,
// 80, 96, 112, 128, 160, 192 and 256. Compiled only when the library is built for sm_90a (HF_PAGED_SM90A, set by kernels/_build.py on compute
// capability 9.0 devices); otherwise fn == nullptr.
constexpr int kPrefillConfigWgmma = 3;
constexpr int kPrefillConfigWgmmaSerial = 4;
PrefillKernel prefill_kernel_wgmma_f16(int head_dim, bool pipelined);
PrefillKernel prefill_kernel_wgmma_bf16(int head_dim, bool pipelined);

}  // namespace hf_paged
