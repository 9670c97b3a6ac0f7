// Plain C++ interface of the layer kernels (layer_ops.cu): the work of a decoder layer outside attention and the
// matrix products, for layers that run eagerly (no torch.compile): RMSNorm (with the residual add before it, or
// alone), SiLU(gate) * up and the rotary embedding of queries and keys, each one launch where transformers' modules
// take several. Each rounds where the modules' own operators round (to the tensors' dtype after every operator of
// theirs), so that a kernel and the module it stands for give the same values.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hf_paged {

enum class LayerDtype { kFloat, kHalf, kBFloat16 };

// out[r, :] = weight * to_dtype(h * rsqrt(mean(h^2) + eps)) with h = x[r, :], in float32 up to the cast, as
// transformers' Llama-family RMSNorm computes it; with a residual, h = to_dtype(residual[r, :] + x[r, :]) (the
// decoder layer's residual add), written to sum_out. x and residual rows have their own strides; out and sum_out are
// contiguous [rows, hidden].
struct RmsNormParams {
  void* out;
  void* sum_out;          // with a residual only
  const void* x;
  const void* residual;   // nullptr: no add
  const void* weight;
  int64_t rows, x_row_stride, residual_row_stride;
  int hidden;
  float eps;
  bool vectorized;        // 16-byte accesses: every row and the weight aligned to them
};
cudaError_t launch_rms_norm(LayerDtype dtype, const RmsNormParams& p, cudaStream_t stream);

// out[r, :] = to_dtype(silu(gate[r, :])) * up[r, :], rounded to the dtype after each operator; out is contiguous
// [rows, width], gate and up rows have their own strides.
cudaError_t launch_silu_and_mul(LayerDtype dtype, void* out, const void* gate, const void* up, int64_t rows, int width,
                                int64_t gate_row_stride, int64_t up_row_stride, bool vectorized, cudaStream_t stream);

// The rotary embedding of transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin for the queries and the
// keys of a [batch, heads, tokens, head_dim] layout (any strides, head_dim contiguous), cos and sin
// [batch or 1, tokens, head_dim] (any strides, head_dim contiguous; batch stride 0 when shared).
struct RotaryParams {
  void* q_out;
  void* k_out;
  const void* q;
  const void* k;
  const void* cos;
  const void* sin;
  int64_t q_stride[3], k_stride[3], q_out_stride[3], k_out_stride[3];  // batch, head, token (elements)
  int64_t cos_stride[2], sin_stride[2];                                // batch, token
  int batch, tokens, q_heads, k_heads, head_dim;
};
cudaError_t launch_rotary(LayerDtype dtype, const RotaryParams& p, cudaStream_t stream);

}  // namespace hf_paged
