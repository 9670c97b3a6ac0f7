"""The ``cuda`` backend: hf_paged's own kernels (``hf_paged/csrc``) for every phase and KV writes.

Tried after flash and before torch. It serves ``Phase.DECODE`` with the split-K decode kernel, ``Phase.PREFILL``
and ``Phase.EXTEND`` (mixed prefill + decode steps included) with the paged prefill kernel (float16/bfloat16,
head_dim 64/128), both at any block size with GQA and ALiBi, and the KV write of every phase. The kernels are built
on the first CUDA call; if that is impossible (no nvcc, no ninja) this backend declines with the reason and the
torch backend serves.
"""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.attention.backends.base import (
    AttentionBackend,
    AttentionCall,
    AttentionParams,
    register_backend,
)
from hf_paged.attention.metadata import PagedMetadata, Phase
from hf_paged.kernels.prefill import PREFILL_DTYPES, PREFILL_HEAD_DIMS, paged_prefill


def _dtype_head_dim_reason(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    if device_type != "cuda":
        return f"tensors are on {device_type}, not a CUDA device"
    if dtype not in kernels.DECODE_DTYPES:
        return f"dtype {dtype} is not compiled (float16, bfloat16, float32 are)"
    if head_dim not in kernels.DECODE_HEAD_DIMS:
        return f"head_dim {head_dim} is not compiled (64, 128, 256 are)"
    return None


@register_backend
class CudaBackend(AttentionBackend):
    """Decode, prefill / extend and KV write through hf_paged's CUDA kernels."""

    name = "cuda"
    priority = 10

    def unsupported_reason(self, call: AttentionCall) -> str | None:
        reason = _dtype_head_dim_reason(call.device_type, call.dtype, call.head_dim)
        if reason is not None:
            return reason
        if call.phase is not Phase.DECODE and call.dtype not in PREFILL_DTYPES:
            return f"the prefill kernel serves float16 and bfloat16, not {call.dtype}"
        if call.phase is not Phase.DECODE and call.head_dim not in PREFILL_HEAD_DIMS:
            return f"the prefill kernel serves head_dim 64 and 128, not {call.head_dim}"
        if call.sliding_window is not None:
            return "sliding-window attention is not implemented in the cuda kernels"
        if call.softcap is not None:
            return "logit softcapping is not implemented in the cuda kernels"
        if call.num_kv_heads <= 0 or call.num_heads % call.num_kv_heads:
            return f"num_heads {call.num_heads} is not a multiple of num_kv_heads {call.num_kv_heads}"
        # Last, since it may build the kernels (about a minute, once per machine).
        reason = kernels.unavailable_reason()
        return None if reason is None else f"CUDA kernels unavailable: {reason}"

    def write_unsupported_reason(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        reason = _dtype_head_dim_reason(device_type, dtype, head_dim)
        if reason is not None:
            return reason
        reason = kernels.unavailable_reason()
        return None if reason is None else f"CUDA kernels unavailable: {reason}"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedMetadata,
    ) -> None:
        kernels.write_kv(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        alibi = params.alibi_slopes
        if alibi is not None:
            alibi = alibi.to(query.device, torch.float32)
        if meta.phase is not Phase.DECODE:
            # query [T, H, D] packed by cu_seqlens_q; the new tokens' K/V are already in the cache, so one kernel
            # serves prefill and extend alike. max_seqlen_q is a host int: no sync.
            return paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                                 params.scale, max_seqlen_q=meta.max_seqlen_q, alibi_slopes=alibi)
        # Decode: query is [B, H, D] (one token per sequence), and meta.max_seqlen_k is a host int, so no sync.
        return kernels.paged_decode(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_k,
            params.scale,
            max_seq_len=meta.max_seqlen_k,
            alibi_slopes=alibi,
        )
