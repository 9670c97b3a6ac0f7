// Registers torch.ops.hf_paged.peer_sum (the kernel in peer_sum.cu): the sum of `x` over the ranks of a
// tensor-parallel group whose symmetric buffers `buffers` addresses, on the current stream, allocating only the
// output; and its fused forms peer_sum_add (plus a residual) and peer_sum_add_rms_norm (plus a residual, then an
// RMSNorm of each row). hf_paged/parallel/_all_reduce.py sets the buffers up and calls them.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "checks.h"
#include "peer_sum.h"

namespace hf_paged {
namespace {

// The checks and arguments every form shares; `out` is allocated like x.
PeerSumArgs common_args(const at::Tensor& x, const at::Tensor& buffers, int64_t rank, int64_t buffer_bytes,
                        double timeout_s, at::Tensor& out) {
  const at::Device device = x.device();
  check_cuda_tensor(x, "x", device), check_cuda_tensor(buffers, "buffers", device);
  const auto dtype = x.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                              format("peer_sum serves float32, float16 and bfloat16, got %s (NCCL serves the rest)",
                                     c10::toString(dtype)));
  const int64_t world = buffers.numel();
  TORCH_CHECK_VALUE(buffers.scalar_type() == at::kLong && buffers.dim() == 1 && buffers.is_contiguous() &&
                        world >= 2 && world <= kPeerSumMaxRanks,
                    format("buffers must be a contiguous int64 [world_size] tensor of 2 to %d addresses, got %s %s",
                           kPeerSumMaxRanks, c10::toString(buffers.scalar_type()), shape_of(buffers).c_str()));
  TORCH_CHECK_VALUE(0 <= rank && rank < world, format("rank %lld is not in [0, %lld)", static_cast<long long>(rank),
                                                      static_cast<long long>(world)));
  const int64_t bytes = x.numel() * x.element_size();
  // The two data halves take what the control words leave, each rounded down to 16 bytes.
  const int64_t half_bytes = (buffer_bytes - kPeerSumControlBytes) / 2 / 16 * 16;
  TORCH_CHECK_VALUE(half_bytes > 0, format("buffer_bytes must exceed the %lld control bytes, got %lld",
                                           static_cast<long long>(kPeerSumControlBytes),
                                           static_cast<long long>(buffer_bytes)));
  TORCH_CHECK_VALUE(x.is_contiguous() && aligned16(x) && bytes % 16 == 0 && bytes <= half_bytes,
                    format("x must be contiguous, 16-byte aligned, a multiple of 16 bytes and at most %lld bytes "
                           "(half of the buffer after its control words), got %s of %lld bytes",
                           static_cast<long long>(half_bytes), shape_of(x).c_str(), static_cast<long long>(bytes)));
  TORCH_CHECK_VALUE(std::isfinite(timeout_s) && timeout_s >= 0,
                    format("timeout_s must be finite and >= 0, got %g", timeout_s));
  out = at::empty_like(x, at::MemoryFormat::Contiguous);
  PeerSumArgs args{};
  args.in = x.data_ptr(), args.out = out.data_ptr(), args.n16 = bytes / 16;
  args.buffers = reinterpret_cast<const uint64_t*>(buffers.data_ptr<int64_t>());
  args.half_bytes = half_bytes, args.rank = static_cast<int>(rank), args.world_size = static_cast<int>(world);
  args.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  return args;
}

int dtype_code(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? 0 : x.scalar_type() == at::kHalf ? 1 : 2;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& x) {
  check_cuda_tensor(t, name, x.device());
  TORCH_CHECK_VALUE(t.scalar_type() == x.scalar_type() && t.sizes() == x.sizes() && t.is_contiguous() && aligned16(t),
                    format("%s must be a contiguous, 16-byte aligned %s tensor shaped like x %s, got %s %s", name,
                           c10::toString(x.scalar_type()), shape_of(x).c_str(), c10::toString(t.scalar_type()),
                           shape_of(t).c_str()));
}

at::Tensor peer_sum(const at::Tensor& x, const at::Tensor& buffers, int64_t rank, int64_t buffer_bytes,
                    double timeout_s) {
  at::Tensor out;
  PeerSumArgs args = common_args(x, buffers, rank, buffer_bytes, timeout_s, out);
  if (args.n16 == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_peer_sum(args, dtype_code(x), c10::cuda::getCurrentCUDAStream()));
  return out;
}

// residual + (the sum of x over the ranks), each rounded to x's dtype as the unfused layer rounds them.
at::Tensor peer_sum_add(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& buffers, int64_t rank,
                        int64_t buffer_bytes, double timeout_s) {
  at::Tensor out;
  PeerSumArgs args = common_args(x, buffers, rank, buffer_bytes, timeout_s, out);
  check_like(residual, "residual", x);
  if (args.n16 == 0) return out;
  args.residual = residual.data_ptr();
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_peer_sum(args, dtype_code(x), c10::cuda::getCurrentCUDAStream()));
  return out;
}

// (h, norm): h = residual + (the sum of x over the ranks), norm = weight * (h * rsqrt(mean(h^2, -1) + eps)), the
// RMSNorm of Llama-style layers (float32 inside, rounded to x's dtype before the weight).
std::tuple<at::Tensor, at::Tensor> peer_sum_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps,
                                                         const at::Tensor& buffers, int64_t rank,
                                                         int64_t buffer_bytes, double timeout_s) {
  at::Tensor out;
  PeerSumArgs args = common_args(x, buffers, rank, buffer_bytes, timeout_s, out);
  check_like(residual, "residual", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have a last (hidden) dimension");
  const int64_t hidden = x.size(-1);
  const int64_t row_bytes = hidden * x.element_size();
  check_cuda_tensor(weight, "weight", x.device());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == hidden &&
                        weight.is_contiguous() && aligned16(weight),
                    format("weight must be a contiguous, 16-byte aligned %s [%lld] tensor, got %s %s",
                           c10::toString(x.scalar_type()), static_cast<long long>(hidden),
                           c10::toString(weight.scalar_type()), shape_of(weight).c_str()));
  TORCH_CHECK_VALUE(row_bytes % 16 == 0 && row_bytes > 0 &&
                        row_bytes / 16 <= static_cast<int64_t>(kPeerSumThreads) * kPeerSumMaxRowUnitsPerThread,
                    format("the fused norm serves rows of a multiple of 16 bytes up to %d bytes, got %lld",
                           kPeerSumThreads * kPeerSumMaxRowUnitsPerThread * 16, static_cast<long long>(row_bytes)));
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, format("eps must be finite and >= 0, got %g", eps));
  at::Tensor norm = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (args.n16 == 0) return {out, norm};
  args.residual = residual.data_ptr(), args.weight = weight.data_ptr(), args.norm_out = norm.data_ptr();
  args.row_units = static_cast<int>(row_bytes / 16), args.eps = static_cast<float>(eps);
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_peer_sum(args, dtype_code(x), c10::cuda::getCurrentCUDAStream()));
  return {out, norm};
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("peer_sum(Tensor x, Tensor buffers, int rank, int buffer_bytes, float timeout_s) -> Tensor");
  m.def("peer_sum_add(Tensor x, Tensor residual, Tensor buffers, int rank, int buffer_bytes, float timeout_s) -> "
        "Tensor");
  m.def("peer_sum_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, Tensor buffers, int rank, "
        "int buffer_bytes, float timeout_s) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("peer_sum", &hf_paged::peer_sum);
  m.impl("peer_sum_add", &hf_paged::peer_sum_add);
  m.impl("peer_sum_add_rms_norm", &hf_paged::peer_sum_add_rms_norm);
}
