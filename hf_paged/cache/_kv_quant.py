"""fp8 (e4m3) KV cache: the names users give it, its per-head scales, the quantizing write and the dequantizing read.

Each layer keeps a float32 scale per KV head for K and for V (``KVScales``, ``[num_kv_heads]`` each); the pool holds
``x / scale`` in ``torch.float8_e4m3fn``, and readers compute with ``fp8 * scale``.

Scale policy: a head's scale is fixed by the first write that reaches it, as ``absmax(x of that head) * 4 / 448``
(4x headroom over what the first write saw), and never changes after that, so every value already stored keeps its
meaning. The update is a ``torch.where`` on the device (no host sync, fixed shapes). Its limit: values more than 4x
above the first write's absmax saturate to +-448 * scale (clamped, never NaN or inf), so a first prompt much tamer
than later ones costs accuracy. A ``PagedAttentionCache`` unsets them when a new batch starts (each ``generate``
call), so a reused cache gives what a new one gives; an ``Engine`` fixes them at its first step, for its lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.cache._config import check_kv_cache_dtype

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_HEADROOM = 4.0
FP8_NOT_SERVED_HERE = "fp8 KV cache is served by the cuda (decode, KV write) and torch backends, not this one"


@dataclass(frozen=True)
class KVScales:
    """One layer's dequantization scales: ``k``, ``v`` float32 ``[num_kv_heads]`` (0 = not set yet)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def unset(cls, num_kv_heads: int, device: torch.device) -> KVScales:
        return cls(torch.zeros(num_kv_heads, dtype=torch.float32, device=device),
                   torch.zeros(num_kv_heads, dtype=torch.float32, device=device))

    def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()


def kv_storage_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores for ``kv_cache_dtype`` (None / "auto": the model's; "fp8" / "fp8_e4m3": e4m3)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype in (None, "auto") else FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def fix_unset_scales(scale: torch.Tensor, x: torch.Tensor) -> None:
    """Set the heads of ``scale`` [Hkv] still 0 from ``x`` [T, Hkv, D] (in place, on the device, no host sync)."""
    if x.shape[0] == 0:
        return
    fresh = x.abs().amax(dim=(0, 2)).float() * (SCALE_HEADROOM / FP8_MAX)
    fresh = torch.nan_to_num(fresh, nan=0.0, posinf=0.0)  # a broken write leaves the head unset
    scale.copy_(torch.where(scale > 0, scale, fresh))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [T, Hkv, D] / ``scale`` [Hkv] as e4m3, saturating at +-448 (an unset scale divides by 1)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x.float() / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 ``x`` [..., Hkv, D] times ``scale`` [Hkv], in ``dtype``."""
    return x.to(dtype) * scale.to(dtype)[:, None]


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (same bytes), for the copies CPU kernels lack for fp8; other dtypes unchanged."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def write_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, scales: KVScales) -> None:
    """Quantize ``key``/``value`` [T, Hkv, D] into fp8 ``k_cache``/``v_cache`` at ``slots`` [T] (all >= 0), fixing
    the scales of heads this is the first write of."""
    for new, cache, scale in ((key, k_cache, scales.k), (value, v_cache, scales.v)):
        fix_unset_scales(scale, new)
        flat = raw_bytes(cache).view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, quantize(new, scale).view(torch.uint8))
