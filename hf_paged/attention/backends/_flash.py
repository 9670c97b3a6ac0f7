"""flash-attn 2 backend: ``flash_attn_varlen_func`` for steps with prefill, ``flash_attn_with_kvcache`` for decode.

Per phase (see :class:`~hf_paged.attention._metadata.Phase`):

- ``PREFILL``: no sequence has a cached prefix, so the step's packed new K/V are the whole context:
  ``flash_attn_varlen_func`` over them with ``cu_seqlens``. Any block size.
- ``EXTEND``: ``flash_attn_varlen_func`` reads K/V from the paged cache through ``block_table``.
- ``DECODE``: ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``, one query per sequence.

flash-attn 2 reads a paged cache only when ``block_size % 256 == 0``, so EXTEND and DECODE at other block sizes
are declared unsupported and the dispatcher hands them to the next backend. flash-attn is imported lazily, once.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import torch

from hf_paged.attention.backends.base import AttentionBackend, AttentionCall, AttentionInputs, register_backend
from hf_paged.cache._kv_quant import FP8_NOT_SERVED_HERE, is_fp8
from hf_paged.attention._metadata import Phase

# What the kernels serve. Module-level so the CPU tests (which run a float64 stand-in for flash-attn) can widen them.
_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
PAGED_BLOCK_MULTIPLE = 256
_INSTALL_HINT = "pip install hf-paged[flash]"

_NOT_LOADED = object()
_flash_attn: ModuleType | None | object = _NOT_LOADED  # the import result, cached (None: unavailable)
_import_error: str | None = None


def load_flash_attn() -> ModuleType | None:
    """The ``flash_attn`` module, or None (with the reason in ``_import_error``); imported on first use only."""
    global _flash_attn, _import_error
    if _flash_attn is _NOT_LOADED:
        _flash_attn, _import_error = _import_flash_attn()
    return _flash_attn  # type: ignore[return-value]


def _import_flash_attn() -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module("flash_attn")
    except (ImportError, OSError) as err:  # not installed, or e.g. built against another torch or CUDA
        if isinstance(err, ModuleNotFoundError) and err.name == "flash_attn":
            return None, f"flash-attn is not installed ({_INSTALL_HINT})"
        return None, f"flash-attn failed to import ({err}); reinstall it ({_INSTALL_HINT})"
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if varlen is None or getattr(module, "flash_attn_with_kvcache", None) is None:
        return None, f"flash-attn lacks flash_attn_varlen_func/flash_attn_with_kvcache; install 2.6+ ({_INSTALL_HINT})"
    params = inspect.signature(varlen).parameters
    if "block_table" not in params or "softcap" not in params:
        return None, f"flash-attn is too old (no paged varlen or softcap); install 2.6+ ({_INSTALL_HINT})"
    return module, None


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """flash-attn's ``(left, right)`` window for "query ``i`` sees key ``j`` when ``i - j < sliding_window``".

    With ``causal=True`` the right side is 0 anyway; ``(-1, -1)`` means no window.
    """
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


@register_backend
class FlashBackend(AttentionBackend):
    """Paged attention through flash-attn 2 on CUDA (fp16/bf16, head_dim <= 256 and a multiple of 8)."""

    name = "flash"
    priority = 0
    # Decode's flash_attn_with_kvcache sizes its splits from the tensors' shapes (the block table's width), reads
    # lengths and tables on the device and allocates through torch's allocator (a graph's pool when capturing).
    capture_safe_decode = True

    def unsupported_reason(self, call: AttentionCall) -> str | None:
        if call.kv_dtype is not None and is_fp8(call.kv_dtype):
            return FP8_NOT_SERVED_HERE
        if load_flash_attn() is None:
            return _import_error
        if call.device_type not in _DEVICE_TYPES:
            return f"flash-attn runs on {', '.join(_DEVICE_TYPES)} only (this layer is on {call.device_type})"
        if call.dtype not in _DTYPES:
            return f"flash-attn needs float16 or bfloat16 (got {call.dtype})"
        if call.head_dim > MAX_HEAD_DIM or call.head_dim % 8:
            return f"flash-attn needs head_dim <= {MAX_HEAD_DIM} and a multiple of 8 (got {call.head_dim})"
        if call.num_heads % call.num_kv_heads:
            return f"num_heads ({call.num_heads}) is not a multiple of num_kv_heads ({call.num_kv_heads})"
        if call.phase is not Phase.PREFILL and call.block_size % PAGED_BLOCK_MULTIPLE:
            return (f"flash-attn 2 reads a paged KV cache only when block_size % {PAGED_BLOCK_MULTIPLE} == 0 "
                    f"(got {call.block_size}); {call.phase.value} needs that, use block_size={PAGED_BLOCK_MULTIPLE}")
        return None

    def forward(self, inputs: AttentionInputs, plan: None) -> torch.Tensor:
        fa = load_flash_attn()
        if fa is None:
            raise RuntimeError(_import_error)
        query, meta, params = inputs.query, inputs.meta, inputs.params
        common = dict(softmax_scale=params.scale, causal=True, window_size=window_size(params.sliding_window),
                      softcap=0.0 if params.softcap is None else params.softcap)
        if meta.phase is Phase.DECODE:
            # One new token per sequence: [T, H, D] is [B, 1, H, D] with the sequence as the batch.
            out = fa.flash_attn_with_kvcache(query.unsqueeze(1), inputs.k_cache, inputs.v_cache,
                                             cache_seqlens=meta.seq_lens_k, block_table=meta.block_tables, **common)
            return out.squeeze(1)
        if meta.phase is Phase.PREFILL:
            # Each context is exactly its new tokens, packed like the queries: no cache read, any block size.
            return fa.flash_attn_varlen_func(query, inputs.key, inputs.value, meta.cu_seqlens_q, meta.cu_seqlens_q,
                                             meta.max_seqlen_q, meta.max_seqlen_q, **common)
        return fa.flash_attn_varlen_func(query, inputs.k_cache, inputs.v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                         meta.max_seqlen_q, meta.max_seqlen_k, block_table=meta.block_tables, **common)
