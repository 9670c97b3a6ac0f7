"""Sliding window and logit softcapping in the prefill kernel (and every other backend that serves them here)
against the float64 torch oracle, on random inputs: the (window, softcap) OPTIONS of tests/gpu/kernel_steps.py over
every prefill scenario there (prefill and extend steps, cached prefixes up to 3995 tokens), every tile
configuration, fp16/bf16 at head sizes 64 and 128, fp32 at 128, block sizes 16 and 48 (not a power of two).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_steps import (OPTIONS, PREFILL_SCENARIOS, QUERY_GAIN, check, other_backends, params_for, prefill_step,
                          reference)

from hf_paged.attention import AttentionCall, AttentionInputs
from hf_paged.kernels._prefill import paged_prefill, prefill_configs

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DTYPE_HEAD_DIMS = {"bf16-d128": (torch.bfloat16, 128), "fp16-d128": (torch.float16, 128),
                   "fp32-d128": (torch.float32, 128), "bf16-d64": (torch.bfloat16, 64), "fp16-d64": (torch.float16, 64)}


@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
def test_prefill_window_and_softcap(heads, head_dim: int, block_size: int, dtype: torch.dtype):
    """Every prefill scenario (cached prefixes up to 3995 tokens) through every tile configuration, and the cuda
    backend's forward, for each (window, softcap)."""
    configs = (-1,) if dtype == torch.float32 else (-1, *prefill_configs(head_dim))
    for scenario, (prefix_lens, new_lens) in PREFILL_SCENARIOS.items():
        gen = torch.Generator().manual_seed(zlib.crc32(repr((scenario, heads, head_dim, block_size, dtype)).encode()))
        meta, query, key, value, k_cache, v_cache, _ = prefill_step(prefix_lens, new_lens, block_size, *heads,
                                                                    head_dim, dtype, gen)
        query = query * QUERY_GAIN
        for window, softcap in OPTIONS:
            params = params_for(head_dim, window, softcap)
            expected = reference(query, k_cache, v_cache, meta, params)
            label = f"{scenario}, window {window} softcap {softcap}"
            for config in configs:
                out = torch.full_like(query, float("nan"))
                paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                              params.scale, max_seqlen_q=meta.max_seqlen_q, out=out, config=config, window=window,
                              softcap=softcap)
                check(out, expected, dtype, f"config {config}, {label}")
            call = AttentionCall(meta.phase, "cuda", dtype, head_dim, *heads, block_size,
                                 sliding_window=params.sliding_window, softcap=params.softcap)
            for backend in other_backends(call):
                inputs = AttentionInputs(query, key, value, k_cache, v_cache, meta, params)
                check(backend.forward(inputs, backend.plan(meta)), expected, dtype, f"{backend.name} backend, {label}")
