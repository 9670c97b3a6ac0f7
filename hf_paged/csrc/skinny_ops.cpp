// Registers torch.ops.hf_paged.skinny_gemm and skinny_gemm_group (the kernel in skinny_gemm.cu, M <= 8):
// x[M, K] @ weight[N, K]^T (+ bias), for one weight or for 2 to 4 sharing x in one launch, on the current stream,
// allocating only the outputs.
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

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
  // K below 2^30: the kernels round K up to whole chunks in int (p.k + kChunk - 1) and must not overflow there.
  TORCH_CHECK_VALUE(x.size(1) % 8 == 0 && x.size(1) < (int64_t{1} << 30) && weight.size(0) <= INT32_MAX,
                    format("K must be a multiple of 8 below 2^30 and N below 2^31, got K %lld, N %lld",
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

// One launch for the weights (checked already) whose outputs are not empty; `outs` one per weight.
void run(const at::Tensor& x, const std::vector<at::Tensor>& weights,
         const std::vector<std::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& outs) {
  SkinnyGemmParams p{};
  for (size_t i = 0; i < weights.size(); ++i) {
    if (outs[i].numel() == 0) continue;
    p.weight[p.count] = weights[i].data_ptr(), p.out[p.count] = outs[i].data_ptr();
    p.bias[p.count] = biases[i].has_value() ? biases[i]->data_ptr() : nullptr;
    p.n[p.count++] = static_cast<int>(weights[i].size(0));
  }
  if (p.count == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [sms, major] = device_shape(x.get_device());
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.m = static_cast<int>(x.size(0)), p.k = static_cast<int>(x.size(1));
  p.bf16 = x.scalar_type() == at::kBFloat16;
  p.sms = sms;
  p.clusters = major >= 9;
  C10_CUDA_CHECK(launch_skinny_gemm(p, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_skinny_arguments(x, weight, bias);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  run(x, {weight}, {bias}, {out});
  return out;
}

// biases: one per weight (None for none) or an empty list (no bias at all).
std::vector<at::Tensor> skinny_gemm_group(const at::Tensor& x, at::TensorList weights,
                                          const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK_VALUE(!weights.empty() && weights.size() <= static_cast<size_t>(kSkinnyMaxGroup),
                    format("skinny_gemm_group serves 1 to %d weights, got %zu; call it per group", kSkinnyMaxGroup,
                           weights.size()));
  TORCH_CHECK_VALUE(biases.empty() || biases.size() == weights.size(),
                    format("biases must hold one entry (a tensor or None) per weight: %zu weights, %zu biases",
                           weights.size(), biases.size()));
  std::vector<at::Tensor> weight_list(weights.begin(), weights.end()), outs;
  std::vector<std::optional<at::Tensor>> bias_list;
  for (size_t i = 0; i < weights.size(); ++i) {
    bias_list.push_back(biases.empty() ? std::nullopt : biases.get(i));
    check_skinny_arguments(x, weights[i], bias_list.back());
    outs.push_back(at::empty({x.size(0), weights[i].size(0)}, x.options()));
  }
  run(x, weight_list, bias_list, outs);
  return outs;
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("skinny_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_gemm_group(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("skinny_gemm", &hf_paged::skinny_gemm);
  m.impl("skinny_gemm_group", &hf_paged::skinny_gemm_group);
}
