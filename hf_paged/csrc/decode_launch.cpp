// How paged decode is launched: residency and shared memory, programmatic dependent launch, the split-K combine
// inside a thread-block cluster, and the diagnostic trace buffer (decode_ops.cpp checks the arguments and plans the
// splits).
#include <c10/cuda/CUDAException.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "checks.h"
#include "decode_launch.h"
#include "launch.h"
#include "ops.h"

namespace hf_paged {
namespace {

// The split-K combine inside a thread-block cluster (HF_PAGED_DECODE_CLUSTER=1, read per launch; decode_cluster.cuh):
// the cluster's size is the split count, so 2 to kMaxClusterSplits splits (16 is H100's non-portable maximum).
// Opt-in until measured.
constexpr int kMaxClusterSplits = 16;
// Tiles before the end of its K/V loop at which a warp of a PDL launch lets the next grid launch: a B=1 x 8192
// decode (8 tiles per warp) took 16.4 / 16.0 / 15.6 / 15.2 / 15.1 / 16.3 us at 0 / 1 / 2 / 3 / 4 / 8 on an H100
// (diagnostic build, back to back): the next grid's prologue and first copies then land in this one's tail.
constexpr int kDecodePdlLeadTiles = 4;

bool decode_cluster_asked() {
  const char* env = std::getenv("HF_PAGED_DECODE_CLUSTER");
  return env != nullptr && std::string(env) == "1";
}

// Whether `k`'s cluster kernel can run clusters of `splits` CTAs with `smem` bytes each on `device` (asked once per
// (device, kernel, splits, smem); raises its shared-memory limit and allows the non-portable sizes first).
bool cluster_fits(const DecodeKernel& k, int splits, int smem, int device) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int>, bool> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(device, k.cluster_fn, splits, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int major = 0, optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) return cache[key] = false;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attrs{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, k.cluster_fn));
  C10_CUDA_CHECK(cudaFuncSetAttribute(k.cluster_fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      optin - static_cast<int>(attrs.sharedSizeBytes)));
  if (splits > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(k.cluster_fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(splits));
  config.blockDim = dim3(k.threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(splits);
  attribute[0].val.clusterDim.y = attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int clusters = 0;
  const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, k.cluster_fn, &config);
  if (err != cudaSuccess) (void)cudaGetLastError();  // an unschedulable size: the plain launch serves
  return cache[key] = err == cudaSuccess && clusters > 0;
}

// The buffer decode_trace_buffer set (undefined: tracing off). Read by paged_decode at each launch, so a launch
// captured into a CUDA graph keeps the buffer set when it was captured.
std::mutex trace_mu;
at::Tensor trace_buffer;

}  // namespace

// Resident CTAs per SM and SM count, asked once per (device, kernel); shared memory raised to what it needs.
std::pair<int, int> decode_residency(const DecodeKernel& k, int device) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, std::pair<int, int>> cache;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({device, k.fn});
  if (it != cache.end()) return it->second;
  int sms = 0, optin = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attrs{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, k.fn));
  // The opt-in limit covers static plus dynamic shared memory.
  const int dynamic_max = optin - static_cast<int>(attrs.sharedSizeBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_max));
  // A typical block-table slice (256 tokens of 16-token blocks) on top of the ring.
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.fn, k.threads, k.smem_bytes + 128));
  return cache[{device, k.fn}] = {std::max(per_sm, 1), sms};
}

int decode_smem_bytes(const DecodeKernel& k, const DecodeParams& p) {
  return k.smem_bytes + ((p.split_len + p.block_size - 1) / p.block_size + 1) * 4;  // + the block-table slice
}

// Programmatic dependent launch for decode (compute capability 9.0 on; HF_PAGED_DECODE_PDL=0 turns it off, read
// per launch): the grid may start while the kernel before it in the stream is finishing. Its CTAs read their
// sequence length and block-table slice and start copying the K/V of keys older than each sequence's newest one
// before they wait for that kernel (decode_common.cuh, wait_for_prior_grid, states the contract), and each warp lets
// the next grid launch kDecodePdlLeadTiles tiles before the end of its K/V loop. On an H100, back to back:
// B=1 x 8192 17.1 -> 13.6 us (82% of the copy bandwidth), B=64 x 512 50.4 -> 46.3 us (docs/kernels.md).
bool decode_pdl(int device) {
  const char* env = std::getenv("HF_PAGED_DECODE_PDL");
  if (env != nullptr && std::string(env) == "0") return false;
  static std::mutex mu;
  static std::map<int, bool> capable;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = capable.find(device);
  if (it != capable.end()) return it->second;
  int major = 0, driver = 0, runtime = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDriverGetVersion(&driver));
  C10_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  // Programmatic launches captured into CUDA graphs need CUDA 12.3 on both sides; older ones launch plainly.
  return capable[device] = major >= 9 && driver >= 12030 && runtime >= 12030;
}

bool decode_cluster(const DecodeKernel& k, const DecodeParams& p, int device) {
  return k.cluster_fn != nullptr && p.max_splits >= 2 && p.max_splits <= kMaxClusterSplits && decode_cluster_asked() &&
         cluster_fits(k, p.max_splits, decode_smem_bytes(k, p), device);
}

// One launch over `rows` query rows (grid z), p's split_len / max_splits splits each; `pdl`: with programmatic
// dependent launch (decode only: the kernels wait before reading what the previous kernel may write); `cluster`:
// k.cluster_fn with one cluster of p.max_splits CTAs per (row, head group) (the caller checked cluster_fits).
void launch_decode(const DecodeKernel& k, const DecodeParams& p, int64_t rows, int device, cudaStream_t stream,
                   bool pdl, bool cluster) {
  decode_residency(k, device);  // raises the kernel's shared-memory limit once per device
  const int smem = decode_smem_bytes(k, p);
  const dim3 grid(static_cast<unsigned>(p.max_splits), static_cast<unsigned>(p.num_kv_heads * p.head_groups),
                  static_cast<unsigned>(rows));
  DecodeParams arg = p;
  arg.pdl_lead = pdl ? kDecodePdlLeadTiles : -1;
  void* args[] = {&arg};
  if (!pdl && !cluster) {
    C10_CUDA_CHECK(cudaLaunchKernel(k.fn, grid, dim3(k.threads), args, smem, stream));
    return;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(k.threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  int n = 0;
  if (pdl) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = static_cast<unsigned>(p.max_splits);
    attribute[n].val.clusterDim.y = attribute[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelExC(&config, cluster ? k.cluster_fn : k.fn, args));
}

// DecodeParams::trace for a launch of `ctas` CTAs on `device`: nullptr when tracing is off (always, outside the
// diagnostic build: no lock on the launch path there).
unsigned long long* decode_trace_for(const at::Device& device, int64_t ctas) {
#ifndef HF_PAGED_DECODE_TRACE
  (void)device, (void)ctas;
  return nullptr;
#else
  const std::lock_guard<std::mutex> lock(trace_mu);
  if (!trace_buffer.defined()) return nullptr;
  TORCH_CHECK_VALUE(trace_buffer.device() == device,
                    format("the decode trace buffer is on %s, this decode on %s", trace_buffer.device().str().c_str(),
                           device.str().c_str()));
  TORCH_CHECK_VALUE(trace_buffer.numel() >= ctas * kTraceWords,
                    format("the decode trace buffer holds %lld words, this launch of %lld CTAs needs %lld",
                           static_cast<long long>(trace_buffer.numel()), static_cast<long long>(ctas),
                           static_cast<long long>(ctas * kTraceWords)));
  return reinterpret_cast<unsigned long long*>(trace_buffer.data_ptr<int64_t>());
#endif
}

int64_t decode_trace_buffer(const std::optional<at::Tensor>& buffer) {
#ifndef HF_PAGED_DECODE_TRACE
  TORCH_CHECK_NOT_IMPLEMENTED(!buffer.has_value(), "these kernels were built without decode tracing; set "
                              "HF_PAGED_KERNEL_TRACE=1 before the process first loads them (a build of its own)");
#endif
  if (buffer.has_value()) {
    check_cuda_tensor(*buffer, "buffer", buffer->device());
    TORCH_CHECK_VALUE(buffer->scalar_type() == at::kLong && buffer->is_contiguous(),
                      "the decode trace buffer must be a contiguous int64 CUDA tensor");
  }
  const std::lock_guard<std::mutex> lock(trace_mu);
  trace_buffer = buffer.has_value() ? *buffer : at::Tensor();
  return kTraceWords;
}

}  // namespace hf_paged
