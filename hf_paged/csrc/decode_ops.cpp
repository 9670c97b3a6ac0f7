// Host side of paged decode: argument checks, the split heuristic, workspace; decode_launch.cpp launches.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "checks.h"
#include "decode_launch.h"
#include "launch.h"
#include "ops.h"

namespace hf_paged {
namespace {

DecodeKernel select_kernel(at::ScalarType dtype, bool e4m3_cache, int head_dim, int group_size) {
  if (e4m3_cache) {
    switch (dtype) {
      case at::kHalf: return decode_kernel_f16_e4m3(head_dim);
      case at::kBFloat16: return decode_kernel_bf16_e4m3(head_dim);
      default: return DecodeKernel{};
    }
  }
  switch (dtype) {
    case at::kFloat: return decode_kernel_f32(head_dim, group_size);
    case at::kHalf: return decode_kernel_f16(head_dim, group_size);
    case at::kBFloat16: return decode_kernel_bf16(head_dim, group_size);
    default: return DecodeKernel{};
  }
}

int64_t head_groups_of(const DecodeKernel& k, int64_t group_size) {
  return (group_size + k.heads_per_cta - 1) / k.heads_per_cta;
}

// The compiled kernel for a checked query / cache pair (NotImplementedError when none is).
DecodeKernel kernel_for(const at::Tensor& query, const at::Tensor& k_cache, const AttentionShape& s) {
  const bool e4m3 = is_e4m3(k_cache);
  const DecodeKernel k = select_kernel(query.scalar_type(), e4m3, static_cast<int>(s.head_dim),
                                       static_cast<int>(s.heads / s.kv_heads));
  TORCH_CHECK_NOT_IMPLEMENTED(k.fn != nullptr || !e4m3,
                              format("paged_decode serves a float8_e4m3fn cache with float16/bfloat16 queries and "
                                     "head_dim 64, 128 or 256; got %s with head_dim %lld",
                                     c10::toString(query.scalar_type()), static_cast<long long>(s.head_dim)));
  TORCH_CHECK_NOT_IMPLEMENTED(k.fn != nullptr,
                              format("paged_decode serves float32/float16/bfloat16 with head_dim 32, 64, 80, 96, 112, "
                                     "128, 160, 192 or 256; got %s with head_dim %lld",
                                     c10::toString(query.scalar_type()), static_cast<long long>(s.head_dim)));
  return k;
}

int round_up(int64_t x, int to) { return static_cast<int>((x + to - 1) / to * to); }

// Split length (a multiple of the tile) for `items` independent (sequence, head group) pieces of up to `max_len`
// tokens. Splitting adds partial-output traffic, so splits stay >= min_split; among split counts, prefer the
// fewest whose last wave of CTAs fills the GPU within 95% of the best (a half-empty last wave idles SMs).
int choose_split_len(const DecodeKernel& k, int64_t items, int64_t max_len, int slots) {
  max_len = std::max<int64_t>(max_len, 1);
  const int64_t max_splits = std::min<int64_t>(kMaxSplits, (max_len + k.min_split - 1) / k.min_split);
  std::vector<std::pair<double, int>> options;  // (fill, split_len)
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int len = round_up((max_len + s - 1) / s, k.tile);
    const int64_t ctas = items * ((max_len + len - 1) / len);
    const int64_t waves = (ctas + slots - 1) / slots;
    options.emplace_back(static_cast<double>(ctas) / static_cast<double>(waves * slots), len);
  }
  double best = 0.0;
  for (const auto& o : options) best = std::max(best, o.first);
  for (const auto& o : options)
    if (o.first >= 0.95 * best) return o.second;
  return options.front().second;
}

int split_len_for(const DecodeKernel& k, const at::Tensor& query, const at::Tensor& k_cache, int64_t max_seq_len) {
  const auto [per_sm, sms] = decode_residency(k, query.get_device());
  const int64_t items = query.size(0) * k_cache.size(2) * head_groups_of(k, query.size(1) / k_cache.size(2));
  return choose_split_len(k, items, max_seq_len, per_sm * sms);
}

// Split tickets must start at zero; the kernel leaves them at zero, so one buffer per (device, stream) is
// allocated once and reused (launches on one stream never overlap; two streams get two buffers).
at::Tensor counters_for(const at::Device& device, cudaStream_t stream, int64_t needed) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> buffers;
  const std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = buffers[{device.index(), stream}];
  if (!buf.defined() || buf.numel() < needed)
    buf = at::zeros({std::max<int64_t>(needed, 1 << 16)}, at::TensorOptions().dtype(at::kInt).device(device));
  return buf;
}

// What decode checks beyond the shared query / cache / table checks.
void check_decode_args(const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& block_tables,
                       int64_t max_seq_len) {
  TORCH_CHECK_VALUE(out.is_contiguous(), "out must be a contiguous [batch, num_heads, head_dim] tensor");
  TORCH_CHECK_VALUE(max_seq_len >= 0 && block_tables.size(1) * k_cache.size(1) >= max_seq_len,
                    format("block_tables has %lld blocks of %lld tokens per row, too few for max_seq_len %lld",
                           static_cast<long long>(block_tables.size(1)), static_cast<long long>(k_cache.size(1)),
                           static_cast<long long>(max_seq_len)));
}

// The kernel keeps its split's slice of the block table in shared memory, on top of its K/V ring.
constexpr int kMaxSliceBytes = 64 * 1024;
bool table_slice_fits(int64_t split_len, int64_t block_size) {
  return ((split_len + block_size - 1) / block_size + 1) * 4 <= kMaxSliceBytes;
}

// Everything but the split settings (and, for prefill rows, the row mapping), from checked tensors.
DecodeParams launch_params(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const AttentionShape& s, const DecodeKernel& k, float scale_log2,
                           const ScoreOptions& o) {
  DecodeParams p{};
  const int group_size = static_cast<int>(s.heads / s.kv_heads);
  p.out = out.data_ptr(), p.query = query.data_ptr(), p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>(), p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.scale_log2 = scale_log2;
  p.window = o.window, p.softcap = o.softcap, p.softcap_inv = o.softcap_inv;
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1);
  p.num_heads = static_cast<int>(s.heads), p.num_kv_heads = static_cast<int>(s.kv_heads);
  p.group_size = group_size, p.head_groups = static_cast<int>(head_groups_of(k, group_size));
  p.block_size = static_cast<int>(s.block_size), p.block_shift = block_shift_of(s.block_size);
  p.table_stride = static_cast<int>(block_tables.stride(0)), p.table_width = static_cast<int>(block_tables.size(1));
  p.max_context = static_cast<int>(std::min<int64_t>(block_tables.size(1) * s.block_size, INT32_MAX));
  return p;
}

}  // namespace

int64_t paged_decode_split_len(const at::Tensor& query, const at::Tensor& k_cache, int64_t max_seq_len,
                               int64_t window) {
  const AttentionShape s = check_query_and_cache(query, query, k_cache, k_cache, "batch", /*allow_e4m3=*/true);
  const c10::cuda::CUDAGuard guard(query.device());
  return split_len_for(kernel_for(query, k_cache, s), query, k_cache, keys_read(max_seq_len, window));
}

int64_t paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len, double scale,
                     int64_t split_len, const std::optional<at::Tensor>& workspace, int64_t window,
                     double softcap, const std::optional<at::Tensor>& counters_arg,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool pdl) {
  const AttentionShape s = check_query_and_cache(out, query, k_cache, v_cache, "batch", /*allow_e4m3=*/true);
  check_kv_scales(k_cache, k_scale, v_scale, query.device());
  check_lengths_and_tables(seq_lens, "seq_lens", block_tables, s.rows, query.device());
  check_decode_args(out, k_cache, block_tables, max_seq_len);
  const float scale_log2 = softmax_scale_log2(scale);
  const ScoreOptions options = score_options(window, softcap, scale);
  const int64_t keys = keys_read(max_seq_len, window);  // what the splits cover: a window shortens them
  const DecodeKernel k = kernel_for(query, k_cache, s);
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t batch = s.rows, heads = s.heads, kv_heads = s.kv_heads;
  if (batch == 0) return 0;
  if (split_len <= 0) split_len = split_len_for(k, query, k_cache, keys);
  TORCH_CHECK_VALUE(split_len % k.tile == 0, format("split_len must be a multiple of %d here, got %lld", k.tile,
                                                   static_cast<long long>(split_len)));
  const int64_t max_splits = std::max<int64_t>(1, (keys + split_len - 1) / split_len);
  TORCH_CHECK_VALUE(max_splits <= kMaxSplits, format("split_len %lld cuts %lld tokens into more than %d splits; use a "
                                                     "longer split", static_cast<long long>(split_len),
                                                     static_cast<long long>(keys), kMaxSplits));
  TORCH_CHECK_VALUE(table_slice_fits(split_len, s.block_size),
                    format("split_len %lld over block_size %lld needs too large a block-table slice; use a longer "
                           "block_size or a shorter split_len", static_cast<long long>(split_len),
                           static_cast<long long>(s.block_size)));

  DecodeParams p = launch_params(out, query, k_cache, v_cache, block_tables, seq_lens, s, k, scale_log2, options);
  p.split_len = static_cast<int>(split_len), p.max_splits = static_cast<int>(max_splits);
  if (k_scale.has_value()) p.k_scale = k_scale->data_ptr<float>(), p.v_scale = v_scale->data_ptr<float>();
  at::Tensor part_out, part_stats, counters;
  if (max_splits > 1) {
    const int64_t out_elems = batch * heads * max_splits * s.head_dim, stats_elems = batch * heads * max_splits * 2;
    if (workspace.has_value()) {
      // A workspace fixed by the caller (a per-step plan, or a CUDA graph's buffers): no allocation here.
      check_cuda_tensor(*workspace, "workspace", query.device());
      TORCH_CHECK_VALUE(workspace->scalar_type() == at::kFloat && workspace->is_contiguous() &&
                            workspace->numel() >= out_elems + stats_elems && aligned16(*workspace),
                        format("workspace must be a contiguous 16-byte aligned float32 tensor of at least %lld "
                               "elements (batch * num_heads * splits * (head_dim + 2)), got %lld",
                               static_cast<long long>(out_elems + stats_elems),
                               static_cast<long long>(workspace->numel())));
      p.part_out = workspace->data_ptr<float>(), p.part_stats = p.part_out + out_elems;
    } else {
      const auto f32 = query.options().dtype(at::kFloat);
      part_out = at::empty({out_elems}, f32);
      part_stats = at::empty({stats_elems}, f32);
      p.part_out = part_out.data_ptr<float>(), p.part_stats = part_stats.data_ptr<float>();
    }
    const int64_t tickets = batch * kv_heads * p.head_groups;
    if (counters_arg.has_value()) {
      // The caller's tickets (a compiled step's own, allocated inside the call): nothing kept past the launch.
      check_cuda_tensor(*counters_arg, "counters", query.device());
      TORCH_CHECK_VALUE(counters_arg->scalar_type() == at::kInt && counters_arg->is_contiguous() &&
                            counters_arg->numel() >= tickets,
                        format("counters must be a contiguous int32 tensor of zeros with at least %lld elements "
                               "(batch * num_heads is always enough), got %lld",
                               static_cast<long long>(tickets), static_cast<long long>(counters_arg->numel())));
      counters = *counters_arg;
    } else {
      counters = counters_for(query.device(), stream, tickets);
    }
    p.counters = counters.data_ptr<int32_t>();
  }
  p.trace = decode_trace_for(query.device(), max_splits * kv_heads * p.head_groups * batch);
  const int device = query.get_device();
  launch_decode(k, p, batch, device, stream, pdl && decode_pdl(device));
  return split_len;
}

void paged_prefill_f32(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                       float scale_log2, const ScoreOptions& options, const AttentionShape& s) {
  const DecodeKernel k = kernel_for(query, k_cache, s);
  const int64_t capacity = block_tables.size(1) * s.block_size;  // one split covers any row: no partials
  const int64_t split_len = std::max<int64_t>(round_up(capacity, k.tile), k.tile);
  TORCH_CHECK_VALUE(table_slice_fits(split_len, s.block_size),
                    format("the float32 prefill reads a whole block-table row (%lld blocks) into shared memory; at "
                           "most %d blocks per row", static_cast<long long>(block_tables.size(1)),
                           kMaxSliceBytes / 4 - 2));
  const c10::cuda::CUDAGuard guard(query.device());
  if (s.rows == 0 || seq_lens_k.numel() == 0) return;
  // The kernel writes [T, H, D] rows densely; a strided `out` gets them through a copy (float32 only).
  at::Tensor dst = out.is_contiguous() ? out : at::empty(query.sizes(), query.options());
  DecodeParams p = launch_params(dst, query, k_cache, v_cache, block_tables, seq_lens_k, s, k, scale_log2, options);
  p.split_len = static_cast<int>(split_len), p.max_splits = 1;
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>(), p.num_seqs = static_cast<int>(seq_lens_k.numel());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t first = 0; first < s.rows; first += 65535) {  // grid z is at most 65535 rows
    p.first_row = static_cast<int>(first);
    launch_decode(k, p, std::min<int64_t>(s.rows - first, 65535), query.get_device(), stream);
  }
  if (!dst.is_same(out)) out.copy_(dst);
}

}  // namespace hf_paged
