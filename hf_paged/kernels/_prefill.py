"""Paged varlen prefill on tensor cores (``hf_paged/csrc/paged_prefill*``), built with the other kernels; float32 on
CUDA cores (each query row as a decode over the keys it sees, through the decode kernel: for tests and float32
models, not for speed).

Shapes: ``T`` packed new tokens of ``B`` sequences, ``H`` query heads, ``Hkv`` kv heads, ``D`` head_dim; the cache
layout shared with every backend, ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]``. An fp8 cache
(``float8_e4m3fn`` with float32 per-kv-head scales) is read for fp16 / bf16 queries and ``kernels.FP8_HEAD_DIMS``,
widened to the query's dtype in shared memory (``csrc/paged_prefill_fp8.cuh``).

``impl="wgmma"`` asks for the Hopper kernel instead (``csrc/paged_prefill_wgmma*.cuh``: sm_90a warpgroup matrix
products, the softmax overlapped with the tensor cores; compute capability 9.0 only, fp16 / bf16 over a cache of the
same dtype, :data:`WGMMA_HEAD_DIMS`), ``impl="wgmma-serial"`` for its simpler form (each product waited for before
the softmax). The cuda backend picks them on Hopper where they serve the layer (docs/design/kernels.md, "Prefill and extend");
called directly, ``impl`` defaults to the mma.sync kernel.
"""

from __future__ import annotations

import torch

from hf_paged.kernels._ops import _check_attention_inputs, _lib

PREFILL_CONFIGS = (0, 1, 2)  # fp16/bf16 tile shapes, see csrc/paged_prefill.cuh; -1 lets the kernel choose
AUTO_CONFIG = -1
WIDEST_CONFIG_0 = 128  # config 0 (32 rows per warp) would spill registers above this head_dim, so is not compiled
# How the op is asked for the Hopper kernels: kPrefillConfigWgmma(Serial) in csrc/paged_prefill.cuh.
WGMMA_CONFIGS = {"wgmma": 3, "wgmma-serial": 4}
IMPLS = ("mma", *WGMMA_CONFIGS)  # mma.sync on every GPU; wgmma on Hopper only
WGMMA_DTYPES = (torch.float16, torch.bfloat16)
WGMMA_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)  # keep in step with paged_prefill_wgmma_<dtype>.cu


def prefill_configs(head_dim: int) -> tuple[int, ...]:
    """The tile configurations compiled for ``head_dim`` (fp16/bf16; float32 has one path and ignores ``config``)."""
    return PREFILL_CONFIGS if head_dim <= WIDEST_CONFIG_0 else PREFILL_CONFIGS[1:]


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seq_lens_k: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                  max_seqlen_q: int | None = None, out: torch.Tensor | None = None, config: int = AUTO_CONFIG,
                  window: int = 0, softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, impl: str = "mma") -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (bottom-right aligned).

    Args:
        query: ``[T, H, D]`` float16, bfloat16 or float32 (``D`` in :data:`~hf_paged.kernels.HEAD_DIMS`; ``H`` a
            multiple of ``Hkv``), each row ``[D]`` contiguous and 16-byte aligned.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, query's dtype, already holding every token of each
            context (the new tokens included); any ``block_size``. Or ``float8_e4m3fn`` with ``k_scale``/``v_scale``
            (query float16 or bfloat16, ``D`` in :data:`~hf_paged.kernels.FP8_HEAD_DIMS`).
        cu_seqlens_q: ``[B + 1]`` int32 prefix sums of the new-token counts. The tensor-core kernels also take
            offsets that start past 0 (rows before ``cu_seqlens_q[0]`` are left as they are); float32 computes
            every row of ``query`` and needs them to start at 0.
        seq_lens_k: ``[B]`` int32 context lengths, new tokens included: new token ``i`` of sequence ``b`` sits at
            position ``seq_lens_k[b] - q_len[b] + i`` and sees keys ``j <= `` that position.
        block_tables: ``[B, max_blocks]`` int32 physical block ids; entries past a sequence's length are not read.
        scale: softmax scale (usually ``D ** -0.5``).
        max_seqlen_q: an upper bound of the new-token counts (host int, sizes the grid); None reads it from
            ``cu_seqlens_q`` (a device sync).
        out: ``[T, H, D]``, query's dtype; allocated if None.
        config: tile shape index (benchmarks), one of :func:`prefill_configs`; -1 picks one.
        window: sliding window (> 0): new token at position ``p`` sees keys ``p - window < j <= p`` only; key tiles
            before every row's window are skipped. 0 = no window.
        softcap: logit softcapping (> 0): scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)``; 0 = off.
        k_scale, v_scale: an fp8 cache's float32 ``[Hkv]`` dequantization scales (value = fp8 * scale), read on the
            device (K's folded into the softmax scale, V's into the output); None for other caches.
        impl: ``"mma"`` (default, every GPU), or ``"wgmma"`` / ``"wgmma-serial"`` (Hopper's kernels;
            ``config`` must stay -1).

    Returns:
        ``[T, H, D]`` in query's dtype. The softmax runs in float32.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl in WGMMA_CONFIGS:
        if (refusal := wgmma_unsupported_reason(query.dtype, k_cache.dtype, query.shape[-1])) is not None:
            raise NotImplementedError(refusal)
        if config != AUTO_CONFIG:
            raise ValueError(f"impl={impl!r} has one tile shape; leave config at {AUTO_CONFIG}, got {config}")
    _check_attention_inputs("paged_prefill", query, k_cache, k_scale, v_scale)
    if config != AUTO_CONFIG and config not in PREFILL_CONFIGS:
        raise ValueError(f"config must be {AUTO_CONFIG} (auto) or one of {PREFILL_CONFIGS}, got {config}")
    if config != AUTO_CONFIG and config not in prefill_configs(query.shape[-1]):
        raise NotImplementedError(f"tile configuration {config} is compiled up to head_dim {WIDEST_CONFIG_0}; use "
                                  f"one of {prefill_configs(query.shape[-1])} or {AUTO_CONFIG} (auto)")
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens_k.numel() else 0
    if query.stride(-1) != 1 or query.stride(-2) % 8 or query.stride(-3) % 8:
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _lib().paged_prefill(out, query, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, max_seqlen_q, scale,
                         WGMMA_CONFIGS.get(impl, config), max(window, 0), max(softcap, 0.0), k_scale, v_scale)
    return out


def wgmma_unsupported_reason(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the wgmma kernels cannot serve these shapes (None if it can, on a compute capability 9.0 GPU; the op
    itself refuses other GPUs, and builds without sm_90a)."""
    if dtype not in WGMMA_DTYPES or kv_dtype != dtype:
        return (f"the wgmma prefill serves {WGMMA_DTYPES} queries over a cache of the same dtype, not {dtype} over "
                f"{kv_dtype}")
    if head_dim not in WGMMA_HEAD_DIMS:
        return f"the wgmma prefill is compiled for head_dim {WGMMA_HEAD_DIMS}, not {head_dim}"
    return None
