// Registers torch.ops.hf_paged.peer_sum (the kernel in peer_sum.cu): the sum of `x` over the ranks of a
// tensor-parallel group whose symmetric buffers `buffers` addresses, on the current stream, allocating only the
// output. hf_paged/hf/tp_all_reduce.py sets the buffers up and calls it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "peer_sum.h"

namespace hf_paged {
namespace {

at::Tensor peer_sum(const at::Tensor& x, const at::Tensor& buffers, int64_t rank, int64_t buffer_bytes,
                    double timeout_s) {
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
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (bytes == 0) return out;
  const c10::cuda::CUDAGuard guard(device);
  PeerSumArgs args{};
  args.in = x.data_ptr(), args.out = out.data_ptr(), args.n16 = bytes / 16;
  args.buffers = reinterpret_cast<const uint64_t*>(buffers.data_ptr<int64_t>());
  args.half_bytes = half_bytes, args.rank = static_cast<int>(rank), args.world_size = static_cast<int>(world);
  args.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  const int code = dtype == at::kFloat ? 0 : dtype == at::kHalf ? 1 : 2;
  C10_CUDA_CHECK(launch_peer_sum(args, code, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("peer_sum(Tensor x, Tensor buffers, int rank, int buffer_bytes, float timeout_s) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) { m.impl("peer_sum", &hf_paged::peer_sum); }
