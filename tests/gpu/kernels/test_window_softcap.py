"""Sliding window and logit softcapping in hf_paged's kernels (and every other backend that serves them here) against
the float64 torch oracle, on random inputs: judged over the whole batch and row by row
(tests/helpers/kernel_oracle.py).

The OPTIONS of tests/gpu/kernel_steps.py: windows shorter than a block (5), not a multiple of any block size (100),
across decode splits and prefill tiles (1000) and longer than every context; softcaps that bend the scores hard (5:
queries are scaled so that scores reach ~±10) and Gemma2's 50. Decode at forced and heuristic splits, prefill and
extend steps with paged prefixes through every tile configuration (test_window_softcap_prefill.py), fp16/bf16/fp32,
block sizes 16/48/256. test_kernel_rows_window.py checks the windows on inputs with exact answers.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_steps import OPTIONS, QUERY_GAIN, check, decode_step, other_backends, params_for, reference

from hf_paged import kernels
from hf_paged.attention import AttentionCall, AttentionInputs, Phase

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DECODE_LENS = [1, 5, 16, 17, 255, 700, 3001, 5000]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [16, 48, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
def test_decode_window_and_softcap(heads, head_dim: int, block_size: int, dtype: torch.dtype):
    """Our kernel at the heuristic split and at forced 64/512-token splits, and every other backend that serves the
    call (the cuda backend's decode plan is keyed by the window), for each (window, softcap)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("decode", heads, head_dim, block_size, dtype)).encode()))
    meta, query, key, value, k_cache, v_cache, _ = decode_step(DECODE_LENS, block_size, *heads, head_dim, dtype, gen)
    query = query * QUERY_GAIN
    for window, softcap in OPTIONS:
        params = params_for(head_dim, window, softcap)
        expected = reference(query, k_cache, v_cache, meta, params)
        label = f"window {window} softcap {softcap}"
        for split_len in (0, 64, 512):
            out = torch.full_like(query, float("nan"))
            kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, params.scale,
                                 max_seq_len=meta.max_seqlen_k, out=out, split_len=split_len, window=window,
                                 softcap=softcap)
            check(out, expected, dtype, f"cuda kernel split {split_len}, {label}")
        call = AttentionCall(Phase.DECODE, "cuda", dtype, head_dim, *heads, block_size,
                             sliding_window=params.sliding_window, softcap=params.softcap)
        backends = other_backends(call)
        assert "cuda" in [b.name for b in backends]
        for backend in backends:
            inputs = AttentionInputs(query, key, value, k_cache, v_cache, meta, params)
            out = backend.forward(inputs, backend.plan(meta))
            check(out, expected, dtype, f"{backend.name} backend, {label}")


def test_windowed_decode_grid_covers_the_window_only():
    """The split grid of a windowed decode is sized by the window, not the context: a 64k-token context with a
    4096-token window gets the splits of a 4096-token one (and so reads ~4096 keys per sequence)."""
    gen = torch.Generator().manual_seed(1)
    meta, query, _, _, k_cache, _, _ = decode_step([5], 16, 32, 8, 128, torch.bfloat16, gen)
    assert kernels.decode_split_len(query, k_cache, 65536, window=4096) == kernels.decode_split_len(query, k_cache,
                                                                                                    4096)
    split = kernels.decode_split_len(query, k_cache, 65536, window=4096)
    assert kernels.decode_workspace_numel(1, 32, 128, 65536, split, window=4096) == kernels.decode_workspace_numel(
        1, 32, 128, 4096, split)
