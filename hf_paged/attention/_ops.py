"""The KV write and the paged attention call as torch custom ops, so ``torch.compile`` treats them as opaque.

A compiled forward cannot trace a backend (flash-attn, the project's CUDA kernels, the torch reference with its
data-dependent indexing), and must not try: each op runs the backend chosen by the dispatcher, by name, exactly as
the eager path calls it, and has a fake implementation that only states the output's shape. Per-step metadata
travels as the op's tensor arguments plus the few host integers that size the kernels (fixed for a compiled decode
step; see ``hf_paged/generate/_static_decode.py``), so the op needs no Python object and no global state.

Shapes (``T`` packed new tokens, ``B`` sequences, ``H`` query heads, ``Hkv`` KV heads, ``D`` head_dim):
    query:             [T, H, D]
    key, value (new):  [T, Hkv, D]
    k_cache, v_cache:  [num_blocks, block_size, Hkv, D]
    output:            [T, H, D], the dtype of ``query``
    k_scale, v_scale:  [Hkv] float32, with an fp8 cache (the layer's dequantization scales; ``store_kv_fp8``
                       writes such a cache, ``paged_attention`` takes them as optional arguments)
"""

from __future__ import annotations

import dataclasses

import torch

from hf_paged.attention.backends.base import AttentionBackend, AttentionInputs, AttentionParams, backend_named
from hf_paged.cache._kv_quant import KVScales
from hf_paged.attention._metadata import PagedMetadata, Phase, build_metadata


@torch.library.custom_op("hf_paged::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, writer: str, has_padding_slots: bool) -> None:
    meta = dataclasses.replace(_NO_STEP, slot_mapping=slot_mapping, has_padding_slots=has_padding_slots)
    backend_named(writer).write_kv(key, value, k_cache, v_cache, meta)


# An op of its own rather than optional scales on store_kv: torch 2.11's fake-tensor check of a custom op fails
# (IndexError) on a mutated argument passed as None.
@torch.library.custom_op("hf_paged::store_kv_fp8", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _store_kv_fp8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, writer: str, has_padding_slots: bool, k_scale: torch.Tensor,
                  v_scale: torch.Tensor) -> None:
    """An fp8 cache's write: its scales are set on a layer's first write (kv_quant), so the op mutates them too."""
    meta = dataclasses.replace(_NO_STEP, slot_mapping=slot_mapping, has_padding_slots=has_padding_slots)
    backend_named(writer).write_kv(key, value, k_cache, v_cache, meta, kv_scales=KVScales(k_scale, v_scale))


@torch.library.custom_op("hf_paged::paged_attention", mutates_args=())
def _paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     seq_lens_k: torch.Tensor, block_tables: torch.Tensor, phase: str, max_seqlen_q: int,
                     max_seqlen_k: int, backend: str, scale: float, sliding_window: int | None, softcap: float | None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    meta = dataclasses.replace(_NO_STEP, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seq_lens_k=seq_lens_k,
                               block_tables=block_tables, phase=Phase(phase), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, block_size=k_cache.shape[1], num_seqs=seq_lens_k.shape[0],
                               num_tokens=query.shape[0])
    params = AttentionParams(scale=scale, sliding_window=sliding_window, softcap=softcap)
    scales = None if k_scale is None else KVScales(k_scale, v_scale)
    served = backend_named(backend)
    return served.forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params, scales), served.plan(meta))


# The fake implementations state only the outputs: the writes return nothing, the attention a tensor like the query.
_store_kv.register_fake(lambda *args, **kwargs: None)
_store_kv_fp8.register_fake(lambda *args, **kwargs: None)
_paged_attention.register_fake(
    lambda query, *args, **kwargs: torch.empty_like(query, memory_format=torch.contiguous_format))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: PagedMetadata, writer: AttentionBackend, kv_scales: KVScales | None = None) -> None:
    """``writer.write_kv(...)`` through the ``hf_paged::store_kv`` op (``key``/``value`` ``[T, Hkv, D]``;
    ``kv_scales``: the layer's, with an fp8 cache)."""
    args = (key, value, k_cache, v_cache, meta.slot_mapping, writer.name, meta.has_padding_slots)
    if kv_scales is None:
        torch.ops.hf_paged.store_kv(*args)
    else:
        torch.ops.hf_paged.store_kv_fp8(*args, kv_scales.k, kv_scales.v)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: PagedMetadata, backend: AttentionBackend,
                    params: AttentionParams, kv_scales: KVScales | None = None) -> torch.Tensor:
    """``backend``'s attention (its plan and forward, on this call alone) through the ``hf_paged::paged_attention``
    op; returns ``[T, H, D]``."""
    k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.k, kv_scales.v)
    return torch.ops.hf_paged.paged_attention(
        query, key, value, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.seq_lens_k,
        meta.block_tables, meta.phase.value, meta.max_seqlen_q, meta.max_seqlen_k, backend.name, params.scale,
        params.sliding_window, params.softcap, k_scale, v_scale)


_EMPTY = torch.empty(0, dtype=torch.int32)
# The step of no sequence, whose fields an op overrides with what it was given: what a backend's verb does not read
# stays empty, and backends allocate their scratch per call.
_NO_STEP = dataclasses.replace(
    build_metadata(q_lens=_EMPTY, seq_lens_k=_EMPTY, block_tables=_EMPTY, slot_mapping=_EMPTY, token_index=None,
                   grid=(0, 0), block_size=0, device=torch.device("cpu")),
    phase=Phase.DECODE, cu_seqlens_q=_EMPTY, cu_seqlens_k=_EMPTY, slot_mapping=_EMPTY, scratch_per_call=True)
