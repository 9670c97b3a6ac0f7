"""The Python side of hf_paged's KV write and paged decode ops: their shapes and argument checks, the launch of
``torch.ops.hf_paged``, and the build's entry points (``_build.py``).

Shapes (``B`` sequences, ``H`` query heads, ``Hkv`` kv heads, ``D`` head_dim, ``T`` new tokens) and the cache
layout shared with every backend: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]``.

Every function raises :class:`KernelsUnavailable` when the kernels cannot be built here (no GPU, nvcc or ninja);
:func:`unavailable_reason` asks without raising. Argument errors raise ``ValueError`` (``NotImplementedError`` for
dtypes / head dims that are not compiled) with what to change. fp16/bf16 decode runs on tensor cores, float32 on
CUDA cores (for tests and float32 models). Both ops serve every head size in :data:`HEAD_DIMS`, and take a sliding
window and logit softcapping as arguments (``window``/``softcap``; 0 = off), as transformers' models define them.

An fp8 cache (``torch.float8_e4m3fn``, with float32 per-KV-head scales: value = fp8 * scale) is written by
:func:`write_kv` (quantizing) and read by :func:`paged_decode` and ``_prefill.paged_prefill`` for fp16 / bf16
queries and :data:`FP8_HEAD_DIMS`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_paged.kernels._build import KernelsUnavailable, ensure_loaded, load

__all__ = ["DECODE_DTYPES", "FP8_HEAD_DIMS", "FP8_QUERY_DTYPES", "HEAD_DIMS", "KernelsUnavailable", "decode_keys",
           "decode_split_len", "decode_workspace_numel", "paged_decode", "prebuild", "unavailable_reason", "write_kv"]

DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head sizes compiled for decode and prefill, every dtype: flash-attn 2's common sizes (multiples of 16 up to 256 that
# models use). Other multiples of 8 are refused; keep in step with the switch statements in hf_paged/csrc.
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
# What the decode and prefill kernels compile for an fp8 (e4m3) cache: keep in step with select_mma_e4m3_kernel and
# paged_prefill_<dtype>_e4m3.cu in hf_paged/csrc.
FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16)
FP8_HEAD_DIMS = (64, 128, 256)


#: ``unavailable_reason()``: None if the kernels are loaded (building them on first call), else why not (warned about
#: once).
unavailable_reason = ensure_loaded


def prebuild(verbose: bool = True) -> Path:
    """Build the kernels for the present GPU now (``hf-paged build-kernels``); returns the build folder."""
    return load(verbose=verbose)


def _lib():
    load()
    return torch.ops.hf_paged


def _check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An fp8 cache needs both scales, any other cache neither (``ValueError`` saying which); the C++ ops check
    the rest (dtype, shape, device)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("a float8_e4m3fn cache needs its k_scale and v_scale (float32 [num_kv_heads] each, "
                         "value = fp8 * scale)")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale and v_scale dequantize a float8_e4m3fn cache; this cache is {k_cache.dtype}: "
                         "pass None")


def _check_attention_inputs(op: str, query: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                            v_scale: torch.Tensor | None) -> None:
    """The checks the decode and prefill ops share: the scales (:func:`_check_kv_scales`), CUDA tensors
    (``ValueError``), and a query dtype and head_dim compiled for this cache (``NotImplementedError`` naming them)."""
    _check_kv_scales(k_cache, k_scale, v_scale)
    if not query.is_cuda:
        raise ValueError(f"{op} needs CUDA tensors, got query on {query.device}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    dtypes, head_dims = (FP8_QUERY_DTYPES, FP8_HEAD_DIMS) if fp8 else (DECODE_DTYPES, HEAD_DIMS)
    if query.dtype not in dtypes or query.shape[-1] not in head_dims:
        raise NotImplementedError(
            f"{op}{' over a float8_e4m3fn cache' if fp8 else ''} is compiled for {dtypes} queries and head_dim "
            f"{head_dims}; got {query.dtype} with head_dim {query.shape[-1]} (the torch backend serves other shapes)"
        )


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V rows into the cache in place.

    Args:
        key, value: ``[T, Hkv, D]``, the cache's dtype (float32, float16 or bfloat16 for an fp8 cache); each
            token's ``[Hkv, D]`` contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous.
        slot_mapping: ``[T]`` int64, ``block * block_size + offset`` per token; ``-1`` rows are skipped. Slots must
            lie below ``num_blocks * block_size`` (not checked on the device).
        k_scale, v_scale: with a ``float8_e4m3fn`` cache, its float32 ``[Hkv]`` scales: rows are stored as
            ``x / scale`` rounded to e4m3 (saturating at +-448), and a head whose scale is still 0 first gets
            ``absmax * 4 / 448`` of the rows written (``hf_paged.cache._kv_quant``'s policy, on the device, no
            host sync). None for other caches.
    """
    _check_kv_scales(k_cache, k_scale, v_scale)
    key, value = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (key, value))
    _lib().write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, max_seq_len: int | None = None,
                 out: torch.Tensor | None = None, split_len: int = 0, workspace: torch.Tensor | None = None,
                 window: int = 0, softcap: float = 0.0, counters: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 pdl: bool = True) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    Args:
        query: ``[B, H, D]`` float16, bfloat16 or float32 (``D`` in :data:`HEAD_DIMS`; ``H`` a multiple of ``Hkv``).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, query's dtype, holding every token of each context
            (the new token's K/V included); or ``float8_e4m3fn`` with ``k_scale``/``v_scale`` (query float16 or
            bfloat16, ``D`` in :data:`FP8_HEAD_DIMS`).
        block_tables: ``[B, max_blocks]`` int32 physical block ids; entries past a sequence's length are ignored.
        seq_lens: ``[B]`` int32 context lengths, new token included; the query sits at position ``seq_len - 1``.
        scale: softmax scale (usually ``D ** -0.5``).
        max_seq_len: an upper bound of ``seq_lens`` (host int, sizes the split-K grid); None reads it from
            ``seq_lens`` (a device sync).
        out: ``[B, H, D]`` contiguous, query's dtype; allocated if None.
        split_len: context tokens per thread block (a multiple of the kernel's tile); 0 = heuristic.
        workspace: float32 storage for the split partials, at least :func:`decode_workspace_numel` elements;
            None allocates per call. With ``split_len``, ``max_seq_len``, ``window`` and ``workspace`` fixed, the
            launch depends on no host value of the step, so it can be captured in a CUDA graph.
        window: sliding window (> 0): the query at position ``p`` sees keys ``p - window < j <= p`` only, and the
            kernel reads only those (its splits cover ``min(max_seq_len, window)`` keys); 0 = the whole context.
        softcap: logit softcapping (> 0): scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before
            the softmax (Gemma2); 0 = off.
        counters: int32 zeros, at least ``B * H`` elements: the tickets that tell each (row, head group) which split
            finishes last; the kernel leaves them at zero. None uses one buffer per (device, stream), allocated on
            the first split launch there and kept for good: a caller whose launches are captured into a CUDA graph
            pool that must hold no long-lived allocation (``torch.compile``'s CUDA graph trees) passes its own.
        k_scale, v_scale: an fp8 cache's float32 ``[Hkv]`` dequantization scales (value = fp8 * scale), read on the
            device (K's folded into the softmax scale, V's into the output); None for other caches.
        pdl: launch with programmatic dependent launch where the device allows it (below); False launches plainly
            (the same kernel and split, so the same bits: tests and benchmarks compare the two).

    Returns:
        ``[B, H, D]`` in query's dtype. The softmax runs in float32.

    From compute capability 9.0 on the launch uses programmatic dependent launch: it may start while the kernel
    before it in the stream finishes, and copies cache entries of keys older than each sequence's newest one before
    it waits for that kernel. So the kernel right before it may write each sequence's newest key and value (as
    :func:`write_kv` does in a decode step) and the query, but no older key.
    """
    _check_attention_inputs("paged_decode", query, k_cache, k_scale, v_scale)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _lib().paged_decode(out, query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, split_len,
                        workspace, max(window, 0), max(softcap, 0.0), counters, k_scale, v_scale, pdl)
    return out


def decode_keys(max_seq_len: int, window: int = 0) -> int:
    """How many keys a decode query reads at most, which the split-K grid covers: the window when it is shorter."""
    return min(max_seq_len, window) if window > 0 else max_seq_len


def decode_workspace_numel(batch: int, num_heads: int, head_dim: int, max_seq_len: int, split_len: int,
                           window: int = 0) -> int:
    """float32 elements :func:`paged_decode` needs for its split partials (0 when one split covers every context)."""
    splits = max(1, -(-decode_keys(max_seq_len, window) // split_len))
    return 0 if splits == 1 else batch * num_heads * splits * (head_dim + 2)


def decode_split_len(query: torch.Tensor, k_cache: torch.Tensor, max_seq_len: int, window: int = 0) -> int:
    """The split length the heuristic picks for :func:`paged_decode` with these shapes (tokens per thread block)."""
    return int(_lib().paged_decode_split_len(query, k_cache, max_seq_len, max(window, 0)))
