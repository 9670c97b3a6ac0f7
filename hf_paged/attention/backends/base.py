"""The backend contract: what a paged-attention backend declares, and its verbs: :meth:`~AttentionBackend.plan` once
per step, :meth:`~AttentionBackend.forward` once per layer on one :class:`AttentionInputs` record, and the KV write.

A backend lives in one file of this package and registers itself with :func:`register_backend`; the dispatcher
(:mod:`hf_paged.attention._dispatch`) imports every module here, so adding a backend is a one-file change.

Shapes (``T`` packed new tokens, ``B`` sequences, ``H`` query heads, ``Hkv`` KV heads, ``D`` head_dim):
    query:            [T, H, D]
    key, value (new): [T, Hkv, D]
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], the model's dtype or float8_e4m3fn
    kv_scales:        with an fp8 cache, the layer's :class:`KVScales` (float32 [Hkv] for K and V), else None
    output:           [T, H, D], the dtype of ``query``
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from hf_paged.cache._kv_quant import KVScales, is_fp8, write_quantized
from hf_paged.attention._metadata import PagedMetadata, Phase


@dataclass(frozen=True)
class AttentionCall:
    """What one layer asks for in one step; a backend serves it or says why not."""

    phase: Phase
    device_type: str
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    sliding_window: int | None = None
    softcap: float | None = None
    kv_dtype: torch.dtype | None = None  # the cache's dtype when it is not ``dtype`` (an fp8 cache)


@dataclass(frozen=True)
class AttentionParams:
    """Per-layer scalars of the attention math.

    ``sliding_window``: a query at position ``i`` sees keys at ``j`` with ``i - j < sliding_window`` (None = all).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax (None = off).
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(slots=True)
class AttentionInputs:
    """One layer's attention in one step, as :meth:`AttentionBackend.forward` reads it (shapes above).

    ``key``/``value`` are the step's new tokens, already in the cache when the backend runs, passed too so that a
    ``Phase.PREFILL`` step can skip reading the cache. ``meta``: the step's metadata on the layer's device.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedMetadata
    params: AttentionParams
    kv_scales: KVScales | None = None


class AttentionBackend(ABC):
    """One way to run paged attention. Subclasses set ``name`` and ``priority`` (lower is tried first)."""

    name: str = ""
    priority: int = 100
    #: Whether :meth:`write_kv` may be captured in a CUDA graph (no host sync, no data-dependent shapes).
    capture_safe_write: bool = False
    #: Whether :meth:`forward` of a decode step may be captured (see :meth:`graph_unsupported_reason`).
    capture_safe_decode: bool = False

    @abstractmethod
    def unsupported_reason(self, call: AttentionCall) -> str | None:
        """None if this backend can serve ``call``, else a short reason (shown when no allowed backend can serve)."""

    def graph_unsupported_reason(self, call: AttentionCall) -> str | None:
        """None if :meth:`forward` for ``call`` may be captured in a CUDA graph and replayed for later steps of the
        same shape (every step-dependent value read from device memory or fixed by the step's shapes), else why
        not. Only decode steps are captured, those of a backend that declares ``capture_safe_decode``."""
        if not self.capture_safe_decode:
            return f"the {self.name} backend's {call.phase.value} attention is not capture-safe"
        return None if call.phase is Phase.DECODE else f"only decode steps are captured, not {call.phase.value}"

    def write_unsupported_reason(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        """None if this backend has its own KV write for such a cache, else why not (the torch one serves)."""
        return "no KV-write kernel of its own"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedMetadata, kv_scales: KVScales | None = None) -> None:
        """Scatter the new ``key``/``value`` into their slots (``meta.slot_mapping``); -1 slots are skipped. An fp8
        cache gets them quantized with ``kv_scales`` (see :mod:`hf_paged.cache._kv_quant`)."""
        slots = meta.slot_mapping
        if meta.has_padding_slots:
            keep = slots >= 0
            key, value, slots = key[keep], value[keep], slots[keep]
        if not is_fp8(k_cache.dtype):
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
        elif kv_scales is None:
            raise RuntimeError("an fp8 KV cache was written without its scales")
        else:
            write_quantized(key, value, k_cache, v_cache, slots, kv_scales)

    def plan(self, meta: PagedMetadata) -> Any:
        """What this backend decides once per step, on the device of ``meta``, for every layer's :meth:`forward` to
        reuse (split lengths, workspaces, rows cut from the metadata), or None (the default). The step keeps it
        (``PagedStep.plan``), so the metadata stays as it was built."""
        return None

    @abstractmethod
    def forward(self, inputs: AttentionInputs, plan: Any) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole context (bottom-right aligned); ``plan``:
        what :meth:`plan` returned for this step. With an fp8 cache (``call.kv_dtype``), ``inputs.kv_scales``
        dequantize it; a backend that cannot read one refuses it in :meth:`unsupported_reason`."""


_REGISTRY: dict[str, AttentionBackend] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: instantiate and register a backend under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    _REGISTRY[cls.name] = cls()
    return cls


def backend_named(name: str) -> AttentionBackend:
    """The registered backend called ``name`` (how the custom ops in ``hf_paged.attention._ops`` find theirs)."""
    return _REGISTRY[name]


def registered_backends() -> list[AttentionBackend]:
    """All registered backends, in the order the dispatcher tries them."""
    return sorted(_REGISTRY.values(), key=lambda b: b.priority)
