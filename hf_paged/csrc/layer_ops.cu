// The layer kernels of layer_ops.h. Every product and sum that transformers' modules round to the tensor's dtype is
// rounded here too (__fmul_rn / __fadd_rn keep nvcc from contracting them into one fused multiply-add).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_sum.cuh"
#include "layer_ops.h"
#include "vec.cuh"

namespace hf_paged {
namespace {

// v rounded to T and back: what a torch operator on T tensors leaves of a float32 result.
template <typename T>
__device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

// N elements of T that load and store as one access (N * sizeof(T) bytes, aligned to it).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

constexpr int kThreads = 256;

// One block per row; N elements per access (hidden % N == 0 and the rows aligned to N elements). With a residual,
// the row normalized is residual + x, rounded to T as torch's add rounds it, and written to sum_out first (each thread
// reads back only what it wrote).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(T* __restrict__ out, T* __restrict__ sum_out,
                                                            const T* __restrict__ x, const T* __restrict__ residual,
                                                            const T* __restrict__ weight, int hidden,
                                                            int64_t x_row_stride, int64_t residual_row_stride,
                                                            float eps) {
  using P = Pack<T, N>;
  const P* row = reinterpret_cast<const P*>(x + blockIdx.x * x_row_stride);
  const P* res = residual ? reinterpret_cast<const P*>(residual + blockIdx.x * residual_row_stride) : nullptr;
  P* sums = res ? reinterpret_cast<P*>(sum_out + blockIdx.x * static_cast<int64_t>(hidden)) : nullptr;
  P* dst = reinterpret_cast<P*>(out + blockIdx.x * static_cast<int64_t>(hidden));
  const P* w = reinterpret_cast<const P*>(weight);
  const int packs = hidden / N;
  __shared__ float scratch[kThreads / 32];
  float sum = 0.f;
  for (int i = threadIdx.x; i < packs; i += kThreads) {
    P p = row[i];
    if (res) {
      const P q = res[i];
#pragma unroll
      for (int j = 0; j < N; ++j) p.v[j] = from_float<T>(__fadd_rn(to_float(q.v[j]), to_float(p.v[j])));
      sums[i] = p;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float v = to_float(p.v[j]);
      sum += v * v;
    }
  }
  // torch's mean multiplies the sum by 1 / n; the rsqrt of the variance plus eps is taken in float32
  const float inv = rsqrtf(__fadd_rn(__fmul_rn(block_sum<kThreads>(sum, scratch), 1.f / hidden), eps));
  for (int i = threadIdx.x; i < packs; i += kThreads) {
    const P p = res ? sums[i] : row[i], wp = w[i];
    P o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float normed = rounded<T>(__fmul_rn(to_float(p.v[j]), inv));
      o.v[j] = from_float<T>(__fmul_rn(to_float(wp.v[j]), normed));
    }
    dst[i] = o;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate,
                                                                const T* __restrict__ up, int width,
                                                                int64_t gate_row_stride, int64_t up_row_stride) {
  using P = Pack<T, N>;
  const int64_t r = blockIdx.x;
  const int i = blockIdx.y * kThreads + threadIdx.x;  // pack index in the row
  if (i >= width / N) return;
  const P g = reinterpret_cast<const P*>(gate + r * gate_row_stride)[i];
  const P u = reinterpret_cast<const P*>(up + r * up_row_stride)[i];
  P o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float a = to_float(g.v[j]);
    const float silu = rounded<T>(__fdiv_rn(a, __fadd_rn(1.f, expf(-a))));  // torch's silu: x / (1 + exp(-x))
    o.v[j] = from_float<T>(__fmul_rn(silu, to_float(u.v[j])));
  }
  reinterpret_cast<P*>(out + r * static_cast<int64_t>(width))[i] = o;
}

// One block per (token, batch row); the threads run over the (query and key) heads' pairs (j, j + head_dim / 2).
template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_kernel(RotaryParams p) {
  const int t = blockIdx.x, b = blockIdx.y, half = p.head_dim / 2;
  const T* cos = static_cast<const T*>(p.cos) + b * p.cos_stride[0] + t * p.cos_stride[1];
  const T* sin = static_cast<const T*>(p.sin) + b * p.sin_stride[0] + t * p.sin_stride[1];
  const int total = (p.q_heads + p.k_heads) * half;
  for (int i = threadIdx.x; i < total; i += kThreads) {
    const int head = i / half, j = i % half;
    const bool is_q = head < p.q_heads;
    const int h = is_q ? head : head - p.q_heads;
    const int64_t* s = is_q ? p.q_stride : p.k_stride;
    const int64_t* o = is_q ? p.q_out_stride : p.k_out_stride;
    const T* src = static_cast<const T*>(is_q ? p.q : p.k) + b * s[0] + h * s[1] + t * s[2];
    T* dst = static_cast<T*>(is_q ? p.q_out : p.k_out) + b * o[0] + h * o[1] + t * o[2];
    const float x1 = to_float(src[j]), x2 = to_float(src[j + half]);
    // rotate_half(x) = cat(-x2, x1); each product and the sum rounded as torch's operators round them
    const float lo = __fadd_rn(rounded<T>(__fmul_rn(x1, to_float(cos[j]))),
                               rounded<T>(__fmul_rn(-x2, to_float(sin[j]))));
    const float hi = __fadd_rn(rounded<T>(__fmul_rn(x2, to_float(cos[j + half]))),
                               rounded<T>(__fmul_rn(x1, to_float(sin[j + half]))));
    dst[j] = from_float<T>(lo);
    dst[j + half] = from_float<T>(hi);
  }
}

template <typename T>
cudaError_t rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kVec = Elem<T>::kVec;
  const auto run = [&](auto kernel) {
    kernel<<<p.rows, kThreads, 0, stream>>>(static_cast<T*>(p.out), static_cast<T*>(p.sum_out),
                                           static_cast<const T*>(p.x), static_cast<const T*>(p.residual),
                                           static_cast<const T*>(p.weight), p.hidden, p.x_row_stride,
                                           p.residual_row_stride, p.eps);
  };
  if (p.vectorized) {
    run(rms_norm_kernel<T, kVec>);
  } else {
    run(rms_norm_kernel<T, 1>);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t silu_and_mul(void* out, const void* gate, const void* up, int64_t rows, int width, int64_t gate_stride,
                         int64_t up_stride, bool vectorized, cudaStream_t stream) {
  constexpr int kVec = Elem<T>::kVec;
  const int n = vectorized ? kVec : 1;
  const dim3 grid(static_cast<unsigned>(rows), (width / n + kThreads - 1) / kThreads);
  if (vectorized) {
    silu_and_mul_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(gate),
                                                                 static_cast<const T*>(up), width, gate_stride,
                                                                 up_stride);
  } else {
    silu_and_mul_kernel<T, 1><<<grid, kThreads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(gate),
                                                              static_cast<const T*>(up), width, gate_stride,
                                                              up_stride);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(LayerDtype dtype, const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (dtype) {
    case LayerDtype::kFloat: return rms_norm<float>(p, stream);
    case LayerDtype::kHalf: return rms_norm<__half>(p, stream);
    case LayerDtype::kBFloat16: return rms_norm<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_silu_and_mul(LayerDtype dtype, void* out, const void* gate, const void* up, int64_t rows, int width,
                                int64_t gate_row_stride, int64_t up_row_stride, bool vectorized, cudaStream_t stream) {
  if (rows == 0 || width == 0) return cudaSuccess;
  switch (dtype) {
    case LayerDtype::kFloat:
      return silu_and_mul<float>(out, gate, up, rows, width, gate_row_stride, up_row_stride, vectorized, stream);
    case LayerDtype::kHalf:
      return silu_and_mul<__half>(out, gate, up, rows, width, gate_row_stride, up_row_stride, vectorized, stream);
    case LayerDtype::kBFloat16:
      return silu_and_mul<__nv_bfloat16>(out, gate, up, rows, width, gate_row_stride, up_row_stride, vectorized,
                                         stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_rotary(LayerDtype dtype, const RotaryParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.tokens == 0) return cudaSuccess;
  const dim3 grid(p.tokens, p.batch);
  switch (dtype) {
    case LayerDtype::kFloat: rotary_kernel<float><<<grid, kThreads, 0, stream>>>(p); break;
    case LayerDtype::kHalf: rotary_kernel<__half><<<grid, kThreads, 0, stream>>>(p); break;
    case LayerDtype::kBFloat16: rotary_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace hf_paged
