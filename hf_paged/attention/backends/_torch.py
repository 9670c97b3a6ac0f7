"""Pure PyTorch paged attention: runs on any device and dtype, and is the oracle for every other backend.

It reads each sequence's context through its block table into a padded ``[B, max_k, Hkv, D]`` view, then computes
masked attention with the softmax in float32. Clear rather than fast: GPU serving paths use flash or cuda. It is
also what serves an fp8 KV cache for now, dequantizing what it gathers (``kv_scales``).
"""

from __future__ import annotations

import torch

from hf_paged.attention.backends.base import (AttentionBackend, AttentionCall, AttentionInputs, AttentionParams,
                                              register_backend)
from hf_paged.cache._kv_quant import KVScales, dequantize
from hf_paged.attention._metadata import PagedMetadata


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """``cache`` [num_blocks, bs, Hkv, D] read through ``block_tables`` [B, nb] -> [B, max_len, Hkv, D]."""
    bs = cache.shape[1]
    nb = max(1, -(-max_len // bs))
    blocks = cache[block_tables[:, :nb].long()]  # [B, nb, bs, Hkv, D]
    return blocks.flatten(1, 2)[:, :max_len]


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                              params: AttentionParams, compute_dtype: torch.dtype = torch.float32,
                              kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention of packed ``query`` [T, H, D] over the paged context; returns [T, H, D] in ``query.dtype``.

    Query ``t`` of sequence ``b`` sits at absolute position ``i = seq_lens_k[b] - q_len[b] + t`` and sees keys
    ``j <= i`` (and ``i - j < sliding_window`` when set). Pass ``compute_dtype=torch.float64`` for a reference.
    An fp8 cache needs its ``kv_scales``: the gathered context is dequantized to ``compute_dtype``.
    """
    (num_heads, head_dim), num_kv_heads = query.shape[1:], k_cache.shape[2]
    max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
    q_lens, k_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1], meta.seq_lens_k.long()
    q_idx, k_pos = torch.arange(max_q, device=query.device), torch.arange(max_k, device=query.device)
    batch = len(q_lens)
    q_valid = q_idx[None, :] < q_lens[:, None]  # [B, Q]: the real query rows
    q = query.new_zeros(batch, max_q, num_heads, head_dim)
    q[q_valid] = query  # packed -> padded [B, Q, H, D]
    k = gather_context(k_cache, meta.block_tables, max_k)  # [B, K, Hkv, D]
    v = gather_context(v_cache, meta.block_tables, max_k)
    if kv_scales is not None:
        k, v = dequantize(k, kv_scales.k, compute_dtype), dequantize(v, kv_scales.v, compute_dtype)

    q = q.to(compute_dtype).view(batch, max_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q, k.to(compute_dtype)) * params.scale
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)

    q_pos = (k_lens - q_lens)[:, None] + q_idx[None, :]  # [B, Q]
    rel = q_pos[:, :, None] - k_pos[None, None, :]  # [B, Q, K]: i - j
    visible = (rel >= 0) & (k_pos[None, None, :] < k_lens[:, None, None])
    if params.sliding_window is not None:
        visible &= rel < params.sliding_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows see nothing
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(compute_dtype))
    out = out.reshape(batch, max_q, num_heads, head_dim)
    return out[q_valid].to(query.dtype)


@register_backend
class TorchBackend(AttentionBackend):
    """Serves every phase on every device; sliding window and softcap included."""

    name = "torch"
    priority = 100

    def unsupported_reason(self, call: AttentionCall) -> str | None:
        return None

    def write_unsupported_reason(self, device_type, dtype, head_dim) -> str | None:
        return None

    def forward(self, inputs: AttentionInputs, plan: None) -> torch.Tensor:
        return paged_attention_reference(inputs.query, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.params,
                                         kv_scales=inputs.kv_scales)
