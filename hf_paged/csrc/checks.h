// Host-side argument checks the torch ops share (write_kv, paged_decode, paged_prefill). Every failure raises
// ValueError (TORCH_CHECK_VALUE) with one preformatted message saying what to change.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

namespace hf_paged {

// Error messages: formatted with snprintf and handed to TORCH_CHECK_* as one std::string. On the GPU box
// (extension built by /opt/gcc g++, torch 2.11) a message that TORCH_CHECK assembled itself from several
// arguments (c10::str's ostringstream) crashed the process; a single string takes c10's pass-through path.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string shape_of(const at::Tensor& t);  // "[2, 32, 128]"

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device);
int vec_elems(at::ScalarType dtype);  // elements per 16-byte vector; 0 for unsupported dtypes
bool aligned16(const at::Tensor& t);

// What the attention ops read off query and the cache once their shapes are checked.
struct AttentionShape {
  int64_t rows, heads, kv_heads, head_dim, block_size;
};

// `query` [rows, H, D] (`query_dims` names the rows in messages) over `k_cache`/`v_cache`
// [num_blocks, block_size, Hkv, D]: one CUDA device and one dtype for all four tensors (`out` shaped like query;
// with `allow_e4m3`, the caches may instead both be float8_e4m3fn), H a multiple of Hkv, contiguous 16-byte aligned
// caches with fewer than 2^31 token slots, query and out rows contiguous and 16-byte aligned (their row strides may
// be larger than H * D).
AttentionShape check_query_and_cache(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const char* query_dims, bool allow_e4m3 = false);

bool is_e4m3(const at::Tensor& cache);  // a float8_e4m3fn tensor

// The dequantization scales of `k_cache`: with a float8_e4m3fn cache both are required, float32 contiguous
// [num_kv_heads] tensors on `device`; with any other cache both must be absent.
void check_kv_scales(const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, const at::Device& device);

// `lens` a contiguous int32 [batch] tensor; `block_tables` an int32 [batch, max_blocks] tensor with contiguous
// rows; both on `device`. `batch` up to 65535 (a grid dimension).
void check_lengths_and_tables(const at::Tensor& lens, const char* lens_name, const at::Tensor& block_tables,
                              int64_t batch, const at::Device& device);

// scale * log2(e) for kernels that exponentiate in base 2; the scale must be positive.
float softmax_scale_log2(double scale);

// A sliding window and logit softcapping as the kernels take them (launch.h's DecodeParams): window <= 0 or
// softcap <= 0 turn them off (window kNoWindow, softcap 0). The cap is handed over in units of q.k
// (softcap / scale), so that kernels apply it to raw scores before their scale.
struct ScoreOptions {
  int window;
  float softcap, softcap_inv;
};
ScoreOptions score_options(int64_t window, double softcap, double scale);

// How many keys a query row reads at most: max_seq_len, or the window when it is shorter.
int64_t keys_read(int64_t max_seq_len, int64_t window);

// log2(block_size) when it is a power of two, else -1 (the kernels then divide).
int block_shift_of(int64_t block_size);

}  // namespace hf_paged
