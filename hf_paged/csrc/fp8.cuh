// e4m3 (torch.float8_e4m3fn) cache elements: unpacking two bytes to one fp16 / bf16 MMA operand register, and the
// quantization the KV write applies. Both are exact where they can be: every e4m3 value is an fp16 and a bf16 value.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace hf_paged {

using E4M3 = __nv_fp8_e4m3;
constexpr float kE4M3Max = 448.f;  // largest finite e4m3fn value: writes saturate here, never to NaN
// A fresh scale is absmax * 4 / 448 (hf_paged/cache/_kv_quant.py); the same float32 constant as torch's.
constexpr float kScaleHeadroom = static_cast<float>(4.0 / 448.0);

// The e4m3 bytes 0 (low half) and 1 (high half) of `pair` as two T values in one register, low byte in the low half.
// fp16: the hardware cvt (sm_89+). bf16: through fp32 (three more instructions, still exact).
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "e4m3 caches serve fp16 and bf16 queries");
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// x / scale as two e4m3 bytes (low half of the result: a), round to nearest even, saturating at +-448 (what torch's
// clamp followed by .to(float8_e4m3fn) gives).
__device__ __forceinline__ uint16_t quantize_e4m3x2(float a, float b, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a / scale, b / scale), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace hf_paged
