// Plain C++ interface between the torch op layer (ops.cpp) and the CUDA kernels (*.cu).
// Nothing here includes torch headers, so the .cu files compile quickly with nvcc alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

// Upper bound on context splits per sequence (sizes the partial-output workspace).
constexpr int kMaxSplits = 256;
// The window of attention without a sliding window: every position i >= 0 sees keys j > i - kNoWindow, i.e. all of
// them, and i - kNoWindow cannot overflow.
constexpr int kNoWindow = INT32_MAX;

// Arguments of one paged-decode launch. Shapes: B sequences, H query heads, Hkv kv heads, D head_dim.
// With a sliding window, the splits cover each sequence's last `window` keys only (split s reads keys
// max(seq_len - window, 0) + s * split_len ...), so a windowed decode reads ~window keys whatever the context.
struct DecodeParams {
  void* out;                  // [B, H, D], query dtype, contiguous
  const void* query;          // [B, H, D], strides q_stride_b / q_stride_h, last dim contiguous
  const void* k_cache;        // [num_blocks, block_size, Hkv, D], contiguous
  const void* v_cache;        // same
  const int32_t* block_tables;  // [B, table_stride]
  const int32_t* seq_lens;    // [B] context length including the new token
  float* part_out;            // [B, H, max_splits, D] unnormalised partial outputs
  float* part_stats;          // [B, H, max_splits, 2] (running max in log2 units, sum of exp2)
  int32_t* counters;          // [B, Hkv, head_groups] split tickets; zero on entry, left zero on exit
  float scale_log2;           // softmax scale * log2(e): the kernel works in base 2
  // Score options (checks.h's ScoreOptions): the query at position i sees keys j with i - window < j <= i
  // (kNoWindow: every key up to i, without a test); raw scores x = q.k become softcap * tanh(x / softcap) before the
  // scale, with the model's softcap divided by the softmax scale (0 = off); softcap_inv = 1 / softcap.
  int window;
  float softcap, softcap_inv;
  int64_t q_stride_b, q_stride_h;
  int num_heads, num_kv_heads, group_size, head_groups;
  int block_size, block_shift;  // block_shift = log2(block_size) or -1 when not a power of two
  int table_stride, table_width;  // block_tables row stride and blocks per row
  int max_context;              // table_stride's blocks * block_size: longer seq_lens are clamped (memory safety)
  int split_len, max_splits;
  // float32 prefill through the CUDA-core kernel (paged_prefill's float32 path): when set, the B "sequences" above
  // are query rows [T, H, D]; row t belongs to the sequence s with cu_seqlens_q[s] <= t < cu_seqlens_q[s + 1] of
  // num_seqs, reads block_tables row s, and sees keys 0 .. its position (seq_lens[s] - q_len + i for new token i).
  // nullptr for decode (the tensor-core kernel never reads these).
  const int32_t* cu_seqlens_q;
  int num_seqs, first_row;  // this launch's grid z = query rows first_row, first_row + 1, ...
  // An e4m3 cache's float32 [Hkv] scales (value = fp8 * scale); nullptr for a cache in the query's dtype.
  const float* k_scale;
  const float* v_scale;
  // -1: launched without programmatic dependent launch. Otherwise (decode_launch.cpp) the tensor-core kernel copies
  // its first K/V tiles of keys older than the newest one before waiting for the previous kernel, and each warp
  // lets the next grid launch pdl_lead tiles before the end of its K/V loop (decode_common.cuh).
  int pdl_lead;
  // Diagnostics only (decode_trace_buffer in decode_launch.cpp; nullptr otherwise): per CTA, kTraceWords uint64 of
  // timestamps at the phases of decode_common.cuh's TracePoint, written by the CTA's first thread.
  unsigned long long* trace;
};

// Words per CTA of DecodeParams::trace: globaltimer (ns) at TracePoint i in word i, clock64 at it in word 8 + i,
// the SM id in word 6, flags (kTraceCombined, kTraceNoSplit) in word 7.
constexpr int kTraceWords = 16;
constexpr unsigned long long kTraceCombined = 1;  // the CTA combined its head group's splits
constexpr unsigned long long kTraceNoSplit = 2;   // the CTA had no split of its sequence to run

// One compiled decode kernel (dtype x head_dim x query heads per kv head) and the constants the host needs.
struct DecodeKernel {
  const void* fn = nullptr;  // __global__ void(DecodeParams); nullptr when the shape is not compiled
  int threads = 0;
  int tile = 0;              // tokens one CTA consumes per pipeline step; split lengths are multiples of it
  int min_split = 0;         // shortest split worth its partial-output traffic
  int smem_bytes = 0;        // dynamic shared memory, without the block-table slice
  int heads_per_cta = 0;     // query heads of one kv head that one CTA serves (more make several head groups)
};

// group_size: query heads per kv head. fp16/bf16 kernels run on tensor cores, float32 on CUDA cores.
DecodeKernel decode_kernel_f32(int head_dim, int group_size);
DecodeKernel decode_kernel_f16(int head_dim, int group_size);
DecodeKernel decode_kernel_bf16(int head_dim, int group_size);
// An e4m3 cache with an fp16 / bf16 query (tensor cores; head_dim 64, 128, 256).
DecodeKernel decode_kernel_f16_e4m3(int head_dim);
DecodeKernel decode_kernel_bf16_e4m3(int head_dim);

// Scatter T tokens of K and V (each row `vecs_per_token` 16-byte vectors) into their cache slots.
cudaError_t launch_write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int64_t num_tokens, int vecs_per_token,
                            int64_t key_row_stride_vecs, int64_t value_row_stride_vecs, cudaStream_t stream);

// What the quantizing KV write reads: key and value rows of this dtype.
enum class KvSource { kFloat, kHalf, kBFloat16 };

// Quantize T tokens of K and V ([T, Hkv, D] rows, row strides in elements, 16-byte aligned, D a multiple of 8) into
// e4m3 caches at their slots (-1 = padding, skipped): x / scale of the head (1 where it is 0), rounded to nearest,
// saturating at +-448. First sets the scales still 0 from the rows written (absmax * 4 / 448; 0 if a value is NaN or
// infinite), as hf_paged/cache/_kv_quant.py does. Two launches, no host sync.
cudaError_t launch_write_kv_e4m3(KvSource source, const void* key, const void* value, void* k_cache, void* v_cache,
                                 float* k_scale, float* v_scale, const int64_t* slot_mapping, int64_t num_tokens,
                                 int num_kv_heads, int head_dim, int64_t key_row_stride, int64_t value_row_stride,
                                 cudaStream_t stream);

// One armed decode step of B = rows sequences (decode_step.cu): seq_lens[i] += 1, cu_seqlens_k[i + 1] += i + 1,
// position[i] += 1, slot_mapping[i] = slot_of[i * slot_stride + position[i]].
cudaError_t launch_advance_decode(int32_t* seq_lens, int32_t* cu_seqlens_k, int64_t* position, const int64_t* slot_of,
                                  int64_t* slot_mapping, int rows, int64_t slot_stride, cudaStream_t stream);

}  // namespace hf_paged
