// Registers torch.ops.hf_paged.skinny_gemm (the kernel in skinny_gemm.cu): x[M, K] @ weight[N, K]^T (+ bias) for
// M <= 8, on the current stream, allocating only the output.
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "checks.h"
#include "skinny_gemm.h"

namespace hf_paged {
namespace {

void check_skinny_arguments(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::Device device = x.device();
  check_cuda_tensor(x, "x", device), check_cuda_tensor(weight, "weight", device);
  const auto dtype = x.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(dtype == at::kHalf || dtype == at::kBFloat16,
                              format("skinny_gemm serves float16 and bfloat16, got %s (F.linear serves the rest)",
                                     c10::toString(dtype)));
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1),
                    format("x must be [rows, K] and weight [N, K], got %s and %s", shape_of(x).c_str(),
                           shape_of(weight).c_str()));
  TORCH_CHECK_VALUE(x.size(0) <= kSkinnyMaxRows, format("skinny_gemm serves at most %d rows of x, got %lld; use "
                                                        "F.linear", kSkinnyMaxRows, static_cast<long long>(x.size(0))));
  TORCH_CHECK_VALUE(x.size(1) % 8 == 0 && x.size(1) <= INT32_MAX && weight.size(0) <= INT32_MAX,
                    format("K must be a multiple of 8 below 2^31 and N below 2^31, got K %lld, N %lld",
                           static_cast<long long>(x.size(1)), static_cast<long long>(weight.size(0))));
  TORCH_CHECK_VALUE(weight.scalar_type() == dtype, format("weight must have x's dtype %s, got %s", c10::toString(dtype),
                                                          c10::toString(weight.scalar_type())));
  TORCH_CHECK_VALUE(weight.is_contiguous() && aligned16(weight),
                    "weight must be contiguous and 16-byte aligned; call .contiguous() first");
  TORCH_CHECK_VALUE(x.stride(1) == 1 && (x.size(0) <= 1 || x.stride(0) % 8 == 0) && aligned16(x),
                    "x rows must be contiguous and start at 16-byte aligned addresses; call .contiguous() first");
  if (bias.has_value()) {
    check_cuda_tensor(*bias, "bias", device);
    TORCH_CHECK_VALUE(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                          bias->is_contiguous(),
                      format("bias must be a contiguous [N] = [%lld] tensor of x's dtype, got %s %s",
                             static_cast<long long>(weight.size(0)), c10::toString(bias->scalar_type()),
                             shape_of(*bias).c_str()));
  }
}

// Multiprocessor count and compute-capability major of `device`, asked once per device.
std::pair<int, int> device_shape(int device) {
  static std::mutex mu;
  static std::map<int, std::pair<int, int>> cache;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return cache[device] = {sms, major};
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_skinny_arguments(x, weight, bias);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [sms, major] = device_shape(x.get_device());
  SkinnyGemmParams p{};
  p.x = x.data_ptr(), p.weight = weight.data_ptr(), p.out = out.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.x_stride = x.stride(0);
  p.m = static_cast<int>(x.size(0)), p.n = static_cast<int>(weight.size(0)), p.k = static_cast<int>(x.size(1));
  p.bf16 = x.scalar_type() == at::kBFloat16;
  p.sms = sms;
  p.clusters = major >= 9;
  C10_CUDA_CHECK(launch_skinny_gemm(p, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("skinny_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("skinny_gemm", &hf_paged::skinny_gemm);
}
