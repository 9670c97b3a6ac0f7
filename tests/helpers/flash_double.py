"""A CPU stand-in for ``flash_attn``: its two inference entry points, written from flash-attn 2.8's documented
semantics in plain float64 PyTorch, so the flash backend's calls can be checked where no GPU is.

It is a second oracle, written apart from ``hf_paged``'s torch backend. What it models, as documented:

- ``causal=True`` aligns the mask to the bottom-right corner: query ``i`` of ``seqlen_q`` sits at key position
  ``i + seqlen_k - seqlen_q``; a row that sees no key outputs zeros.
- ``window_size=(left, right)``: query ``i`` sees keys in ``[i + sk - sq - left, i + sk - sq + right]``; -1 = unbounded.
- ``softcap > 0``: scores become ``softcap * tanh(scores / softcap)``.
- ``alibi_slopes`` ``[H]`` or ``[B, H]``: adds ``-slope * |i + sk - sq - j|`` to the scores.
- GQA: query head ``h`` reads KV head ``h // (H // Hkv)``.
- A paged cache ``[num_blocks, block_size, Hkv, D]`` read through ``block_table`` ``[B, max_blocks]``, where the
  kernels demand ``block_size % 256 == 0`` (and raise otherwise, as here).

Deliberate differences: it runs on any device and accepts float32 (the real kernels want CUDA fp16/bf16), and
features the backend never uses (dropout, new k/v appended by ``flash_attn_with_kvcache``, rotary, LSE) raise.
"""

from __future__ import annotations

import torch

__version__ = "2.8.3+double"
PAGED_BLOCK_MULTIPLE = 256


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _check_int32(name: str, t: torch.Tensor | None) -> None:
    _check(t is None or t.dtype == torch.int32, f"{name} must have dtype int32")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype == k.dtype == v.dtype, "query and key/value must have the same dtype")
    _check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), "only fp16, bf16 (and fp32 here) supported")
    _check(k.stride(-1) == 1 and v.stride(-1) == 1, "k/v must have contiguous last dimension")
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(q.shape[-1] == k.shape[-1] == v.shape[-1], "query, key and value must have the same head dimension")
    _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")


def _check_paged(cache: torch.Tensor, block_table: torch.Tensor) -> None:
    _check_int32("block_table", block_table)
    _check(cache.dim() == 4, "a paged cache is [num_blocks, block_size, nheads_k, headdim]")
    _check(cache.shape[1] % PAGED_BLOCK_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256")


def _read_paged(cache: torch.Tensor, table_row: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Tokens ``0..seqlen-1`` of one sequence: ``cache`` [num_blocks, bs, Hkv, D] -> [seqlen, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(seqlen, device=cache.device)
    blocks = table_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    slopes: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence: ``q`` [sq, H, D], ``k``/``v`` [sk, Hkv, D], ``slopes`` [H] or None -> [sq, H, D] float64."""
    sq, num_heads, _ = q.shape
    sk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [sk, H, D]: query head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale  # [H, sq, sk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    diag = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # key position each query row is aligned to
    delta = torch.arange(sk, device=q.device)[None, :] - diag  # [sq, sk]: j - (i + sk - sq)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        allowed &= delta >= -left
    if right >= 0:
        allowed &= delta <= right
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * delta.abs().double()[None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing output zeros
    return torch.einsum("hij,jhd->ihd", probs, v)


def _slopes_for(alibi_slopes: torch.Tensor | None, b: int, num_heads: int) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    _check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
    _check(alibi_slopes.shape[-1] == num_heads, "ALiBi slopes must be [nheads] or [batch_size, nheads]")
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length attention.

    ``q`` [total_q, H, D]; ``k``/``v`` [total_k, Hkv, D], or with ``block_table`` [B, max_blocks] a paged cache
    [num_blocks, block_size, Hkv, D] whose sequence ``b`` holds ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` tokens.
    Returns [total_q, H, D] in ``q.dtype``.
    """
    _check(dropout_p == 0.0 and not return_attn_probs, "the double models inference only (no dropout, no probs)")
    _check_inputs(q, k, v)
    _check_int32("cu_seqlens_q", cu_seqlens_q)
    _check_int32("cu_seqlens_k", cu_seqlens_k)
    _check(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must match in size")
    if block_table is not None:
        _check_paged(k, block_table)
        _check(block_table.shape[0] == cu_seqlens_q.numel() - 1, "block_table must have batch_size rows")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        _check(sq <= max_seqlen_q and sk <= max_seqlen_k, "a sequence is longer than max_seqlen_q/max_seqlen_k")
        if block_table is None:
            kb, vb = k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        else:
            kb, vb = _read_paged(k, block_table[b], sk), _read_paged(v, block_table[b], sk)
        slopes = _slopes_for(alibi_slopes, b, q.shape[1])
        out[cu_q[b] : cu_q[b + 1]] = _attend(
            q[cu_q[b] : cu_q[b + 1]], kb, vb, scale, causal, window_size, softcap, slopes
        )
    return out.to(q.dtype)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor:
    """Attention of ``q`` [B, sq, H, D] over a KV cache, sequence ``b`` holding ``cache_seqlens[b]`` tokens.

    ``k_cache``/``v_cache``: [B, seqlen_cache, Hkv, D], or with ``block_table`` [B, max_blocks] a paged cache
    [num_blocks, block_size, Hkv, D]. Returns [B, sq, H, D] in ``q.dtype``.
    """
    unmodelled = {"k": k, "v": v, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
                  "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad}
    used = [name for name, t in unmodelled.items() if t is not None]
    if used or return_softmax_lse:
        raise NotImplementedError(f"the flash-attn double does not model {used or 'return_softmax_lse'}")
    _check_inputs(q, k_cache, v_cache)
    _check(q.dim() == 4, "q must be [batch_size, seqlen_q, nheads, headdim]")
    batch = q.shape[0]
    if block_table is not None:
        _check_paged(k_cache, block_table)
        _check(block_table.shape[0] == batch, "block_table must have batch_size rows")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        _check(k_cache.shape[0] >= batch, "k_cache has fewer sequences than q")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        lens = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        _check_int32("cache_seqlens", cache_seqlens)
        lens = cache_seqlens.tolist()
    _check(all(0 <= n <= capacity for n in lens), "cache_seqlens exceeds what the cache (or block_table) holds")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = _read_paged(k_cache, block_table[b], n), _read_paged(v_cache, block_table[b], n)
        slopes = _slopes_for(alibi_slopes, b, q.shape[2])
        out[b] = _attend(q[b], kb, vb, scale, causal, window_size, softcap, slopes)
    return out.to(q.dtype)
