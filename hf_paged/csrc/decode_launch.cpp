// How paged decode is launched: residency and shared memory, programmatic dependent launch, and the diagnostic
// trace buffer (decode_ops.cpp checks the arguments and plans the splits).
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <string>

#include "checks.h"
#include "decode_launch.h"
#include "launch.h"
#include "ops.h"

namespace hf_paged {
namespace {

// Tiles before the end of its K/V loop at which a warp of a PDL launch lets the next grid launch: a B=1 x 8192
// decode (8 tiles per warp) took 16.4 / 16.0 / 15.6 / 15.2 / 15.1 / 16.3 us at 0 / 1 / 2 / 3 / 4 / 8 on an H100
// (diagnostic build, back to back): the next grid's prologue and first copies then land in this one's tail.
constexpr int kDecodePdlLeadTiles = 4;

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

// Programmatic dependent launch for decode (compute capability 9.0 on; paged_decode's `pdl` argument turns it off for
// a launch): the grid may start while the kernel before it in the stream is finishing. Its CTAs read their sequence
// length and block-table slice and start copying the K/V of keys older than each sequence's newest one before they
// wait for that kernel (decode_common.cuh, wait_for_prior_grid, states the contract), and each warp lets the next
// grid launch kDecodePdlLeadTiles tiles before the end of its K/V loop. On an H100, back to back: B=1 x 8192
// 17.1 -> 13.6 us (82% of the copy bandwidth), B=64 x 512 50.4 -> 46.3 us (docs/design/decisions.md).
bool decode_pdl(int device) {
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

// One launch over `rows` query rows (grid z), p's split_len / max_splits splits each; `pdl`: with programmatic
// dependent launch (decode only: the kernels wait before reading what the previous kernel may write).
void launch_decode(const DecodeKernel& k, const DecodeParams& p, int64_t rows, int device, cudaStream_t stream,
                   bool pdl) {
  decode_residency(k, device);  // raises the kernel's shared-memory limit once per device
  const int smem = decode_smem_bytes(k, p);
  const dim3 grid(static_cast<unsigned>(p.max_splits), static_cast<unsigned>(p.num_kv_heads * p.head_groups),
                  static_cast<unsigned>(rows));
  DecodeParams arg = p;
  arg.pdl_lead = pdl ? kDecodePdlLeadTiles : -1;
  void* args[] = {&arg};
  if (!pdl) {
    C10_CUDA_CHECK(cudaLaunchKernel(k.fn, grid, dim3(k.threads), args, smem, stream));
    return;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(k.threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelExC(&config, k.fn, args));
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
