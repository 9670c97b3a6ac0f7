// The torch-facing ops (registered as torch.ops.hf_paged.* in ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace hf_paged {

// Validates every argument (ValueError / NotImplementedError with what to change) and launches on the current
// stream. Returns the split length used (tokens of context per CTA). `workspace` (float32, at least
// batch * num_heads * splits * (head_dim + 2) elements) holds the split partials; without it they are allocated.
// With a fixed split_len, max_seq_len and workspace the launch reads every step-dependent value from device
// memory, so it can be captured in a CUDA graph and replayed for other sequence lengths up to max_seq_len.
// window > 0: the query sees its last `window` keys only, and the splits cover min(max_seq_len, window) keys (the
// workspace shrinks with them); softcap > 0: scores become softcap * tanh(score / softcap) before the softmax.
// counters: the split tickets (int32, zero, left at zero), else one buffer per (device, stream) kept for good.
// A float8_e4m3fn cache (fp16 / bf16 query) needs k_scale / v_scale (float32 [Hkv]: value = fp8 * scale); other
// caches refuse them. pdl: launch with programmatic dependent launch where the device allows it (decode_launch.cpp);
// false launches plainly (the same kernel and split: the same bits).
int64_t paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len, double scale,
                     int64_t split_len, const std::optional<at::Tensor>& workspace, int64_t window, double softcap,
                     const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, bool pdl);

// The split length the heuristic picks for such a launch (for benchmarks and tests).
// Diagnostics: every later paged_decode launch stores per-CTA timestamps into `buffer` (int64, kTraceWords per CTA,
// CTA index (z * grid_y + y) * grid_x + x; launch.h), until called with None. Returns kTraceWords.
int64_t decode_trace_buffer(const std::optional<at::Tensor>& buffer);
int64_t paged_decode_split_len(const at::Tensor& query, const at::Tensor& k_cache, int64_t max_seq_len,
                               int64_t window);

// paged_prefill's float32 path (prefill_ops.cpp checks the arguments): every query row runs as a decode over the
// keys it sees, on the CUDA-core decode kernel, one split per row.
struct AttentionShape;
struct ScoreOptions;
void paged_prefill_f32(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                       float scale_log2, const ScoreOptions& options, const AttentionShape& s);

// Scatters key / value [T, Hkv, D] into the caches at slot_mapping (-1 = skipped). A float8_e4m3fn cache takes
// float32 / fp16 / bf16 rows, quantized with k_scale / v_scale (float32 [Hkv], unset heads (0) set first from the
// rows written: see launch.h); other caches take rows of their own dtype and refuse scales.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale);

}  // namespace hf_paged
