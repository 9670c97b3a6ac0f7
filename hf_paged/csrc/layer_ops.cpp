// Registers torch.ops.hf_paged.{rms_norm, add_rms_norm, silu_and_mul, rotary} (the kernels in layer_ops.cu) with
// their argument checks; each allocates its outputs only and runs on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "layer_ops.h"

namespace hf_paged {
namespace {

LayerDtype layer_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return LayerDtype::kFloat;
    case at::kHalf: return LayerDtype::kHalf;
    case at::kBFloat16: return LayerDtype::kBFloat16;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, format("%s serves float32, float16 and bfloat16, got %s", op,
                                                c10::toString(t.scalar_type())));
  }
  return LayerDtype::kFloat;  // not reached
}

void check_same(const at::Tensor& t, const char* name, const at::Tensor& like, const char* op) {
  check_cuda_tensor(t, name, like.device());
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), format("%s: %s must have dtype %s, got %s", op, name,
                                                                  c10::toString(like.scalar_type()),
                                                                  c10::toString(t.scalar_type())));
}

// Whether rows of `width` elements at `row_stride` can be read as 16-byte packs.
bool packs(const at::Tensor& t, int64_t width, int64_t row_stride, int64_t rows) {
  const int n = vec_elems(t.scalar_type());
  return n > 0 && width % n == 0 && (rows <= 1 || row_stride % n == 0) && aligned16(t);
}

// The rows of `t` ([..., hidden], hidden contiguous) as a [rows, hidden] view, or an error naming it.
at::Tensor rows_of(const at::Tensor& t, int64_t hidden, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(-1) == hidden && t.stride(-1) == 1,
                    format("rms_norm: %s must be [..., %lld] with the last dimension contiguous, got %s", name,
                           static_cast<long long>(hidden), shape_of(t).c_str()));
  at::Tensor rows = t.reshape({-1, hidden});  // a view where the strides allow
  TORCH_CHECK_VALUE(rows.stride(-1) == 1, format("rms_norm: %s's rows must be contiguous", name));
  return rows;
}

// out = RMSNorm(h) for h = x, or h = residual + x (then also returned); see layer_ops.h.
std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                        const at::Tensor& weight, double eps) {
  check_cuda_tensor(x, "x", x.device());
  const LayerDtype dtype = layer_dtype(x, "rms_norm");
  check_same(weight, "weight", x, "rms_norm");
  const int64_t hidden = x.dim() >= 1 ? x.size(-1) : 0;
  TORCH_CHECK_VALUE(hidden > 0 && hidden < (int64_t{1} << 30),
                    format("rms_norm: x must be [..., hidden] with 0 < hidden < 2^30, got %s", shape_of(x).c_str()));
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
                    format("rms_norm: weight must be a contiguous [%lld] tensor, got %s",
                           static_cast<long long>(hidden), shape_of(weight).c_str()));
  const at::Tensor x2 = rows_of(x, hidden, "x");
  at::Tensor r2, sum;
  if (residual.has_value()) {
    check_same(*residual, "residual", x, "rms_norm");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), format("rms_norm: residual must be x's shape %s, got %s",
                                                             shape_of(x).c_str(), shape_of(*residual).c_str()));
    r2 = rows_of(*residual, hidden, "residual");
    sum = at::empty(x.sizes(), x.options());
  }
  const int64_t rows = x2.size(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  RmsNormParams p{};
  p.out = out.data_ptr(), p.x = x2.data_ptr(), p.weight = weight.data_ptr();
  p.sum_out = sum.defined() ? sum.data_ptr() : nullptr, p.residual = r2.defined() ? r2.data_ptr() : nullptr;
  p.rows = rows, p.hidden = static_cast<int>(hidden), p.eps = static_cast<float>(eps);
  p.x_row_stride = x2.stride(0), p.residual_row_stride = r2.defined() ? r2.stride(0) : 0;
  p.vectorized = packs(x2, hidden, x2.stride(0), rows) && aligned16(weight) &&
                 (!r2.defined() || packs(r2, hidden, r2.stride(0), rows));
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_rms_norm(dtype, p, c10::cuda::getCurrentCUDAStream()));
  return {sum, out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<1>(norm(x, std::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm(x, residual, weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_cuda_tensor(gate, "gate", gate.device());
  const LayerDtype dtype = layer_dtype(gate, "silu_and_mul");
  check_same(up, "up", gate, "silu_and_mul");
  TORCH_CHECK_VALUE(gate.dim() >= 1 && gate.sizes() == up.sizes() && gate.stride(-1) == 1 && up.stride(-1) == 1 &&
                        gate.size(-1) < (int64_t{1} << 30),
                    format("silu_and_mul: gate and up must be one shape [..., width] with width contiguous, got %s "
                           "and %s", shape_of(gate).c_str(), shape_of(up).c_str()));
  const int64_t width = gate.size(-1);
  const at::Tensor g = gate.reshape({-1, width}), u = up.reshape({-1, width});
  TORCH_CHECK_VALUE(g.stride(-1) == 1 && u.stride(-1) == 1, "silu_and_mul: gate and up rows must be contiguous");
  const int64_t rows = g.size(0);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const c10::cuda::CUDAGuard guard(gate.device());
  const bool vectorized = packs(g, width, g.stride(0), rows) && packs(u, width, u.stride(0), rows);
  C10_CUDA_CHECK(launch_silu_and_mul(dtype, out.data_ptr(), g.data_ptr(), u.data_ptr(), rows, static_cast<int>(width),
                                     g.stride(0), u.stride(0), vectorized, c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  check_cuda_tensor(q, "q", q.device());
  const LayerDtype dtype = layer_dtype(q, "rotary");
  for (auto [t, name] : {std::pair{&k, "k"}, {&cos, "cos"}, {&sin, "sin"}}) check_same(*t, name, q, "rotary");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                        q.size(3) == k.size(3) && q.size(3) % 2 == 0 && q.stride(3) == 1 && k.stride(3) == 1,
                    format("rotary: q and k must be [batch, heads, tokens, head_dim] with one batch, token count and "
                           "even head_dim, head_dim contiguous, got %s and %s", shape_of(q).c_str(),
                           shape_of(k).c_str()));
  const int64_t batch = q.size(0), tokens = q.size(2), head_dim = q.size(3);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && (t->size(0) == batch || t->size(0) == 1) && t->size(1) == tokens &&
                          t->size(2) == head_dim && t->stride(2) == 1,
                      format("rotary: cos and sin must be [batch or 1, tokens, head_dim] = [%lld, %lld, %lld] with "
                             "head_dim contiguous, got %s", static_cast<long long>(batch),
                             static_cast<long long>(tokens), static_cast<long long>(head_dim),
                             shape_of(*t).c_str()));
  }
  TORCH_CHECK_VALUE(batch <= 65535,
                    format("rotary: at most 65535 batch rows, got %lld", static_cast<long long>(batch)));
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);  // (the inputs' strides: dense layouts kept)
  RotaryParams p{};
  p.q_out = q_out.data_ptr(), p.k_out = k_out.data_ptr(), p.q = q.data_ptr(), p.k = k.data_ptr();
  p.cos = cos.data_ptr(), p.sin = sin.data_ptr();
  for (int d = 0; d < 3; ++d) {
    p.q_stride[d] = q.stride(d), p.k_stride[d] = k.stride(d);
    p.q_out_stride[d] = q_out.stride(d), p.k_out_stride[d] = k_out.stride(d);
  }
  p.cos_stride[0] = cos.size(0) == 1 ? 0 : cos.stride(0), p.cos_stride[1] = cos.stride(1);
  p.sin_stride[0] = sin.size(0) == 1 ? 0 : sin.stride(0), p.sin_stride[1] = sin.stride(1);
  p.batch = static_cast<int>(batch), p.tokens = static_cast<int>(tokens);
  p.q_heads = static_cast<int>(q.size(1)), p.k_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(head_dim);
  const c10::cuda::CUDAGuard guard(q.device());
  C10_CUDA_CHECK(launch_rotary(dtype, p, c10::cuda::getCurrentCUDAStream()));
  return {q_out, k_out};
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("rms_norm", &hf_paged::rms_norm);
  m.impl("add_rms_norm", &hf_paged::add_rms_norm);
  m.impl("silu_and_mul", &hf_paged::silu_and_mul);
  m.impl("rotary", &hf_paged::rotary);
}
