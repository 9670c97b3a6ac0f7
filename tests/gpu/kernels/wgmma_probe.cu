// A standalone probe of csrc/wgmma.cuh for the GPU session: one warpgroup computes D[64 x N] = A[row0 .. row0 + 63]
// [0 .. K) B[K x N] in K / 16 wgmma steps through the helpers and the operand layouts the wgmma prefill uses.
// tests/gpu/test_wgmma_probe_gpu.py builds it for sm_90a with torch's extension loader; it is no part of the library.
//   form 0 (ss, as S = Q K^T): A [128 x K] and B^T [N x K] both K-major in shared memory, written with sw128_offset
//     (A as the Q tile of 128 rows, B^T as a K tile of N rows); k step kk at +32 bytes inside a 64-column panel,
//     panel kk / 4 at rows * 128 bytes: qk_issue's descriptors.
//   form 1 (rs, as O += P V): A from registers (the m16n8k16 A fragment of each warp's 16 rows, as pack_p builds it),
//     B [K x N] MN-major (rows = the contraction, as V) in a tile of kBRows rows, read transposed; k step kk at
//     kk * 16 rows * 128 bytes, LBO = kBRows * 128 (the next 64 columns), SBO = 1024: pv_issue's descriptors.
// lbo / sbo: 0 takes those values, anything else replaces the descriptor field (bytes), so that a failing run can try
// the alternatives without a rebuild. D (float32, [64 x N]) is written from wgmma.cuh's accumulator layout.
// K is a runtime argument, so ptxas serializes the wgmmas (its C7520 note): harmless here, only values are checked.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "wgmma.cuh"

namespace {

namespace wg = hf_paged::wgmma;

constexpr int kARows = 128, kMaxK = 256;
constexpr int kABytes = kARows * kMaxK * 2;  // A tile (ss), from the 1024-aligned base
template <int N>
constexpr int kBRows = N <= 128 ? 128 : 64;  // rs: the prefill's V tile (kBlockN keys)
// The larger of the ss B^T tile (N rows by up to kMaxK columns) and the rs B tile (kBRows rows by N columns in whole
// 64-column panels: N = 32, 96 or 192 leaves the last one partly unused, as in the prefill's V tile).
template <int N>
constexpr int kBBytes = (N * kMaxK > kBRows<N> * ((N + 63) / 64 * 64) ? N * kMaxK : kBRows<N> * ((N + 63) / 64 * 64)) * 2;
template <int N>
constexpr int kSmemBytes = kABytes + kBBytes<N> + 1024;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies a [rows x cols] row-major global matrix into a 128-byte-swizzled tile of kRows rows, 16 bytes per store.
template <int kRows, typename T>
__device__ void store_tile(unsigned char* tile, const T* src, int rows, int cols) {
  const int chunks = cols / 8;
  for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
    const int r = i / chunks, c = i % chunks;
    *reinterpret_cast<uint4*>(tile + wg::sw128_offset<kRows>(r, c)) =
        *reinterpret_cast<const uint4*>(src + r * cols + c * 8);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(128) probe_kernel(const T* a, const T* b, float* d, int form, int row0, int k_len,
                                                    uint32_t lbo, uint32_t sbo) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - smem_u32(smem_raw) % 1024u) % 1024u);
  const uint32_t a_smem = smem_u32(smem), b_smem = a_smem + kABytes;
  // Zero everything first: a read outside what was written then shows as 0 in D.
  for (int i = threadIdx.x; i < (kABytes + kBBytes<N>) / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  if (form == 0) {
    store_tile<kARows>(smem, a, kARows, k_len);
    store_tile<N>(smem + kABytes, b, N, k_len);
  } else {
    store_tile<kBRows<N>>(smem + kABytes, b, k_len, N);
  }
  wg::fence_proxy_async();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // rs: every k step's A fragment, loaded before the fence (wgmma reads them asynchronously).
  uint32_t frag[kMaxK / 16][4];
  const T* a_warp = a + (row0 + 16 * warp + g) * k_len + 2 * t;
  auto pair = [&](int r, int c) { return *reinterpret_cast<const uint32_t*>(a_warp + r * k_len + c); };
#pragma unroll
  for (int kk = 0; kk < kMaxK / 16; ++kk) {
    const bool used = form == 1 && kk < k_len / 16;
    frag[kk][0] = used ? pair(0, 16 * kk) : 0u;
    frag[kk][1] = used ? pair(8, 16 * kk) : 0u;
    frag[kk][2] = used ? pair(0, 16 * kk + 8) : 0u;
    frag[kk][3] = used ? pair(8, 16 * kk + 8) : 0u;
  }

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  wg::fence_operands(acc);
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < kMaxK / 16; ++kk) {
    if (kk >= k_len / 16) break;
    if (form == 0) {
      const uint32_t col = (kk & 3) * 32, l = lbo ? lbo : 16, s = sbo ? sbo : 1024;
      const uint64_t da = wg::sw128_desc(a_smem + row0 * 128 + (kk >> 2) * kARows * 128 + col, l, s);
      const uint64_t db = wg::sw128_desc(b_smem + (kk >> 2) * N * 128 + col, l, s);
      wg::Mma64<T, N>::ss(acc, da, db, kk > 0);
    } else {
      const uint64_t db = wg::sw128_desc(b_smem + kk * 16 * 128, lbo ? lbo : kBRows<N> * 128, sbo ? sbo : 1024);
      wg::Mma64<T, N>::rs(acc, frag[kk], db, kk > 0);
    }
  }
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(acc);
  // acc[4j + e]: row 16 warp + g (+ 8 for e >= 2), column 8j + 2t + (e & 1).
#pragma unroll
  for (int i = 0; i < N / 2; ++i)
    d[(16 * warp + g + 8 * ((i >> 1) & 1)) * N + 8 * (i >> 2) + 2 * t + (i & 1)] = acc[i];
}

template <typename T, int N>
void launch(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& d, int form, int row0, int k_len,
            uint32_t lbo, uint32_t sbo) {
  auto kernel = probe_kernel<T, N>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<N>));
  kernel<<<1, 128, kSmemBytes<N>, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()), d.data_ptr<float>(), form, row0,
      k_len, lbo, sbo);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_n(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& d, int form, int row0, int k_len,
              uint32_t lbo, uint32_t sbo) {
  const int n = d.size(1);
  if (n == 32) return launch<T, 32>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 64) return launch<T, 64>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 80) return launch<T, 80>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 96) return launch<T, 96>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 112) return launch<T, 112>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 128) return launch<T, 128>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 160) return launch<T, 160>(a, b, d, form, row0, k_len, lbo, sbo);
  if (n == 192) return launch<T, 192>(a, b, d, form, row0, k_len, lbo, sbo);
  TORCH_CHECK(n == 256, "N must be 32, 64, 80, 96, 112, 128, 160, 192 or 256");
  launch<T, 256>(a, b, d, form, row0, k_len, lbo, sbo);
}

// a: [128, K]; b: [N, K] (form 0, B^T) or [K, N] (form 1); d: [64, N] float32; all contiguous CUDA tensors.
void probe(torch::Tensor a, torch::Tensor b, torch::Tensor d, int64_t form, int64_t row0, int64_t lbo, int64_t sbo) {
  const int k_len = a.size(1), n = d.size(1);
  TORCH_CHECK(a.is_cuda() && a.is_contiguous() && b.is_contiguous() && d.is_contiguous(), "contiguous CUDA tensors");
  TORCH_CHECK(a.size(0) == kARows && k_len % 16 == 0 && k_len <= kMaxK, "a: [128, K], K a multiple of 16 <= 256");
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && d.scalar_type() == torch::kFloat32 && d.size(0) == 64, "dtypes");
  TORCH_CHECK(form == 0 ? (b.size(0) == n && b.size(1) == k_len) : (b.size(0) == k_len && b.size(1) == n),
              "b: [N, K] for ss, [K, N] for rs");
  TORCH_CHECK(form == 0 || k_len <= (n <= 128 ? 128 : 64), "rs: K at most the V tile's rows");
  TORCH_CHECK(row0 == 0 || row0 == 64, "row0: 0 or 64");
  const c10::cuda::CUDAGuard guard(a.device());
  if (a.scalar_type() == torch::kHalf)
    return launch_n<__half>(a, b, d, form, row0, k_len, lbo, sbo);
  TORCH_CHECK(a.scalar_type() == torch::kBFloat16, "fp16 or bf16");
  launch_n<__nv_bfloat16>(a, b, d, form, row0, k_len, lbo, sbo);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe, "wgmma probe: D[64 x N] = A[64 x K] B[K x N]"); }
