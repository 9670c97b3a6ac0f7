// Registers torch.ops.hf_paged.skinny_gemm and skinny_gemm_group (the kernel in skinny_gemm.cu, M <= 8),
// skinny_gemm_wide and skinny_gemm_wide_group (skinny_gemm_wide.cu, 9 <= M <= 64) and skinny_gemm_wgmma and
// skinny_gemm_wgmma_group (skinny_gemm_wgmma.cu, M <= 64, Hopper only): x[M, K] @ weight[N, K]^T (+ bias),
// for one weight or for 2 to 4 sharing x in one launch, on the current stream, allocating only the outputs.
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

// A kernel as its ops launch it: their name in messages and the rows of x it serves.
struct SkinnyKernel {
  const char* name;
  const char* group_name;
  int min_rows, max_rows;
  cudaError_t (*launch)(const SkinnyGemmParams&, cudaStream_t);
  bool hopper_only;  // sm_90a code: compute capability 9.0 and a build for it
};
constexpr SkinnyKernel kNarrow{"skinny_gemm", "skinny_gemm_group", 0, kSkinnyMaxRows, launch_skinny_gemm};
constexpr SkinnyKernel kWide{"skinny_gemm_wide", "skinny_gemm_wide_group", kSkinnyMaxRows + 1, kSkinnyWideMaxRows,
                             launch_skinny_gemm_wide};
constexpr SkinnyKernel kWgmma{"skinny_gemm_wgmma", "skinny_gemm_wgmma_group", 0, kSkinnyWideMaxRows,
                              launch_skinny_gemm_wgmma, true};

void check_rows(const SkinnyKernel& kernel, int64_t rows) {
  const auto got = static_cast<long long>(rows);
  if (kernel.min_rows == 0) {
    TORCH_CHECK_VALUE(rows <= kernel.max_rows, format("%s serves at most %d rows of x, got %lld; use F.linear",
                                                      kernel.name, kernel.max_rows, got));
  } else {
    TORCH_CHECK_VALUE(rows >= kernel.min_rows && rows <= kernel.max_rows,
                      format("%s serves %d to %d rows of x, got %lld; use skinny_gemm up to %d rows and F.linear "
                             "above %d", kernel.name, kernel.min_rows, kernel.max_rows, got, kSkinnyMaxRows,
                             kernel.max_rows));
  }
}

void check_skinny_arguments(const SkinnyKernel& kernel, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  const at::Device device = x.device();
  check_cuda_tensor(x, "x", device), check_cuda_tensor(weight, "weight", device);
  const auto dtype = x.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(dtype == at::kHalf || dtype == at::kBFloat16,
                              format("%s serves float16 and bfloat16, got %s (F.linear serves the rest)", kernel.name,
                                     c10::toString(dtype)));
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1),
                    format("x must be [rows, K] and weight [N, K], got %s and %s", shape_of(x).c_str(),
                           shape_of(weight).c_str()));
  check_rows(kernel, x.size(0));
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

// One launch of `kernel` for the weights (checked already) whose outputs are not empty; `outs` one per weight.
void run(const SkinnyKernel& kernel, const at::Tensor& x, const std::vector<at::Tensor>& weights,
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
  TORCH_CHECK_NOT_IMPLEMENTED(!kernel.hopper_only || (major == 9 && skinny_gemm_wgmma_built()),
                              format("%s runs on compute capability 9.0 GPUs with kernels built for sm_90a (this GPU "
                                     "is %d.x%s); use skinny_gemm_wide or F.linear", kernel.name, major,
                                     skinny_gemm_wgmma_built() ? "" : ", and the build has no sm_90a code"));
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.m = static_cast<int>(x.size(0)), p.k = static_cast<int>(x.size(1));
  p.bf16 = x.scalar_type() == at::kBFloat16;
  p.sms = sms;
  p.clusters = major >= 9;
  C10_CUDA_CHECK(kernel.launch(p, c10::cuda::getCurrentCUDAStream()));
}

template <const SkinnyKernel& kernel>
at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_skinny_arguments(kernel, x, weight, bias);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  run(kernel, x, {weight}, {bias}, {out});
  return out;
}

// biases: one per weight (None for none) or an empty list (no bias at all).
template <const SkinnyKernel& kernel>
std::vector<at::Tensor> skinny_gemm_group(const at::Tensor& x, at::TensorList weights,
                                          const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK_VALUE(!weights.empty() && weights.size() <= static_cast<size_t>(kSkinnyMaxGroup),
                    format("%s serves 1 to %d weights, got %zu; call it per group", kernel.group_name,
                           kSkinnyMaxGroup, weights.size()));
  TORCH_CHECK_VALUE(biases.empty() || biases.size() == weights.size(),
                    format("biases must hold one entry (a tensor or None) per weight: %zu weights, %zu biases",
                           weights.size(), biases.size()));
  std::vector<at::Tensor> weight_list(weights.begin(), weights.end()), outs;
  std::vector<std::optional<at::Tensor>> bias_list;
  for (size_t i = 0; i < weights.size(); ++i) {
    bias_list.push_back(biases.empty() ? std::nullopt : biases.get(i));
    check_skinny_arguments(kernel, x, weights[i], bias_list.back());
    outs.push_back(at::empty({x.size(0), weights[i].size(0)}, x.options()));
  }
  run(kernel, x, weight_list, bias_list, outs);
  return outs;
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY_FRAGMENT(hf_paged, m) {
  m.def("skinny_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_gemm_group(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def("skinny_gemm_wide(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_gemm_wide_group(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def("skinny_gemm_wgmma(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_gemm_wgmma_group(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("skinny_gemm", &hf_paged::skinny_gemm<hf_paged::kNarrow>);
  m.impl("skinny_gemm_group", &hf_paged::skinny_gemm_group<hf_paged::kNarrow>);
  m.impl("skinny_gemm_wide", &hf_paged::skinny_gemm<hf_paged::kWide>);
  m.impl("skinny_gemm_wide_group", &hf_paged::skinny_gemm_group<hf_paged::kWide>);
  m.impl("skinny_gemm_wgmma", &hf_paged::skinny_gemm<hf_paged::kWgmma>);
  m.impl("skinny_gemm_wgmma_group", &hf_paged::skinny_gemm_group<hf_paged::kWgmma>);
}
