// How paged decode is launched (decode_launch.cpp): decode_ops.cpp's side of it.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <utility>

#include "launch.h"

namespace hf_paged {

// Resident CTAs per SM and SM count, asked once per (device, kernel); raises the kernel's shared-memory limit.
std::pair<int, int> decode_residency(const DecodeKernel& k, int device);

// Dynamic shared memory of a launch: the kernel's ring plus its split's block-table slice.
int decode_smem_bytes(const DecodeKernel& k, const DecodeParams& p);

// Whether decode launches on `device` can use programmatic dependent launch (compute capability 9.0 on, CUDA 12.3
// on in the driver and the runtime).
bool decode_pdl(int device);

// One launch over `rows` query rows (grid z), p's split_len / max_splits splits each.
void launch_decode(const DecodeKernel& k, const DecodeParams& p, int64_t rows, int device, cudaStream_t stream,
                   bool pdl = false);

// DecodeParams::trace for a launch of `ctas` CTAs on `device`: nullptr unless a trace buffer is set.
unsigned long long* decode_trace_for(const at::Device& device, int64_t ctas);

}  // namespace hf_paged
