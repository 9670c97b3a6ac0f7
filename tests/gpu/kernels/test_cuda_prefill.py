"""The paged prefill kernel (``hf_paged/csrc/paged_prefill*``) against the float64 torch oracle, on a GPU.

The grid: cached prefixes from 0 to several thousand tokens, new-token runs from 1 to 4096 (block-size multiples and
ragged tails), block sizes 16/256 (and 48, not a power of two), GQA 32/8, MHA 32/32, MQA 8/1, head_dim 64/128,
fp16/bf16, every tile configuration; and every compiled head size (32 to 256, fp16/bf16 with each tile configuration
compiled for it, fp32 on its CUDA-core path). Each case draws fresh inputs; the cache holds ``POISON`` in slots no
sequence owns (a read past a sequence shows up as a large error) and outputs are NaN-poisoned first (an unwritten row
fails). Each output is judged over the whole batch and row by row (tests/helpers/kernel_oracle.py);
test_kernel_rows_*.py add inputs with exact answers.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_steps import DEVICE, PREFILL_SCENARIOS, check, prefill_step, reference

from hf_paged import kernels
from hf_paged.attention import AttentionCall, AttentionInputs, AttentionParams, Dispatcher, Phase
from hf_paged.attention.backends.base import registered_backends
from hf_paged.kernels._prefill import PREFILL_CONFIGS, paged_prefill, prefill_configs

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

HEADS = {"gqa-32/8": (32, 8), "mha-32/32": (32, 32), "mqa-8/1": (8, 1)}
LONG = {"prefill-4096": ([0], [4096]), "prefix-2048": ([2048, 2500], [2048, 1000])}


def run_ours(query, k_cache, v_cache, meta, params, config: int = -1) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # every element must be written
    return paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                         params.scale, max_seqlen_q=meta.max_seqlen_q, out=out,
                         config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("scenario", PREFILL_SCENARIOS)
def test_prefill_matches_float64_reference(scenario, block_size, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((scenario, block_size, heads, head_dim, dtype)).encode()))
    step = prefill_step(*PREFILL_SCENARIOS[scenario], block_size, *heads, head_dim, dtype, gen)
    meta, query, _, _, k_cache, v_cache, params = step
    check(run_ours(query, k_cache, v_cache, meta, params), reference(query, k_cache, v_cache, meta, params), dtype,
          scenario)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", kernels.HEAD_DIMS)
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
def test_prefill_every_head_size(heads, head_dim: int, dtype: torch.dtype):
    """Every compiled head size at block sizes 16 and 48 (not a power of two), each scenario; fp16/bf16 through
    every tile configuration compiled for the size (config 0 only up to 128), fp32 through its one path."""
    configs = prefill_configs(head_dim) if dtype != torch.float32 else ()  # float32 has its one path (auto)
    for block_size in (16, 48):
        for scenario, (prefix_lens, new_lens) in PREFILL_SCENARIOS.items():
            seed = zlib.crc32(repr((scenario, block_size, heads, head_dim, dtype)).encode())
            gen = torch.Generator().manual_seed(seed)
            meta, query, _, _, k_cache, v_cache, params = prefill_step(prefix_lens, new_lens, block_size, *heads,
                                                                       head_dim, dtype, gen)
            expected = reference(query, k_cache, v_cache, meta, params)
            for config in (-1, *configs):
                check(run_ours(query, k_cache, v_cache, meta, params, config), expected, dtype,
                      f"{scenario} block {block_size} config {config}")


@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16),
                                             (80, torch.float16), (96, torch.float32)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d256", "fp16-d80", "fp32-d96"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("scenario", LONG)
def test_prefill_long_sequences(scenario, block_size, head_dim, dtype):
    """4096 new tokens in one run, and 2048 new tokens after a 2048-token prefix (MQA keeps the oracle small)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((scenario, block_size, head_dim, dtype)).encode()))
    meta, query, _, _, k_cache, v_cache, params = prefill_step(*LONG[scenario], block_size, 8, 1, head_dim, dtype,
                                                               gen)
    check(run_ours(query, k_cache, v_cache, meta, params), reference(query, k_cache, v_cache, meta, params), dtype,
          scenario)


@pytest.mark.parametrize("block_size", [16, 48, 256])
@pytest.mark.parametrize("head_dim, config", [(d, c) for d in kernels.HEAD_DIMS for c in prefill_configs(d)])
def test_every_tile_config(config, head_dim, block_size):
    """Each compiled tile shape (the benchmark times all of them), with a block size that is not a power of two."""
    gen = torch.Generator().manual_seed(config * 1000 + head_dim + block_size)
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 70, 0, 999], [130, 1, 63, 257], block_size, 32, 8,
                                                               head_dim, torch.bfloat16, gen)
    expected = reference(query, k_cache, v_cache, meta, params)
    for _ in range(2):  # same inputs twice: a race shows as a moving error
        check(run_ours(query, k_cache, v_cache, meta, params, config), expected, torch.bfloat16, f"config {config}")


def test_small_grid():
    """Small cases for compute-sanitizer (``-k small_grid``): every dtype, head_dim and config once, plain and with a
    sliding window and softcap."""
    gen = torch.Generator().manual_seed(7)
    for config in PREFILL_CONFIGS:
        for head_dim, dtype, block_size in ((64, torch.float16, 16), (128, torch.bfloat16, 48), (80, torch.float16, 16),
                                            (192, torch.bfloat16, 48), (32, torch.bfloat16, 16)):
            if config not in prefill_configs(head_dim):
                continue
            meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 30, 3], [1, 40, 90], block_size, 4, 2,
                                                                       head_dim, dtype, gen)
            check(run_ours(query, k_cache, v_cache, meta, params, config),
                  reference(query, k_cache, v_cache, meta, params), dtype, f"config {config} d{head_dim}")
            # a sliding window (tiles skipped and masked at its edge) with a softcap
            windowed = AttentionParams(scale=params.scale, sliding_window=20, softcap=5.0)
            out = paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                                params.scale, max_seqlen_q=meta.max_seqlen_q, config=config, window=20, softcap=5.0)
            check(out, reference(query, k_cache, v_cache, meta, windowed), dtype, f"window config {config}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_strided_query_and_out(dtype: torch.dtype):
    """query as a view of a fused QKV projection; out a view of a wider buffer (float32 writes it through a copy)."""
    gen = torch.Generator().manual_seed(11)
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 100], [77, 20], 16, 32, 8, 128, dtype, gen)
    fused = torch.randn(query.shape[0], 48, 128, device=DEVICE, dtype=query.dtype)
    fused[:, :32] = query
    wide = torch.full((query.shape[0], 40, 128), float("nan"), device=DEVICE, dtype=query.dtype)
    out = paged_prefill(fused[:, :32], k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                        params.scale, out=wide[:, 4:36])
    check(out, reference(query, k_cache, v_cache, meta, params), dtype, "strided")
    assert wide[:, :4].isnan().all() and wide[:, 36:].isnan().all(), "wrote outside out's view"


@pytest.mark.parametrize("phase_case", ["prefill", "extend"])
def test_cuda_backend_serves_prefill_and_extend(phase_case):
    """At block size 16 flash-attn can serve a pure prefill (from the new K/V) but not an extend; the dispatcher
    picks cuda where flash cannot, and the cuda backend's output is right either way."""
    gen = torch.Generator().manual_seed(5)
    prefix = [0, 0, 0] if phase_case == "prefill" else [0, 40, 300]
    meta, query, key, value, k_cache, v_cache, params = prefill_step(prefix, [9, 1, 120], 16, 32, 8, 128,
                                                                     torch.bfloat16, gen)
    assert meta.phase is Phase(phase_case)
    call = AttentionCall(meta.phase, "cuda", torch.bfloat16, 128, 32, 8, 16)
    chosen = Dispatcher().select(call).name
    assert chosen == "cuda" or (chosen == "flash" and phase_case == "prefill"), chosen
    backend = next(b for b in registered_backends() if b.name == "cuda")
    out = backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params), backend.plan(meta))
    check(out, reference(query, k_cache, v_cache, meta, params), torch.bfloat16, phase_case)
    window = AttentionCall(meta.phase, "cuda", torch.bfloat16, 128, 32, 8, 16, sliding_window=64, softcap=30.0)
    assert backend.unsupported_reason(window) is None  # both are kernel arguments (test_window_softcap.py)


def test_prefill_rejects_bad_arguments():
    """Last in the file, and at most two errors thrown from the extension: on the GPU box (torch 2.11) a third C++
    error in one process crashed the interpreter, in the decode tests too (cause not yet found)."""
    gen = torch.Generator().manual_seed(4)
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 3], [5, 9], 16, 32, 8, 128, torch.float16, gen)
    args = (k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, 0.1)
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k.long(), meta.block_tables, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill(query.bfloat16(), *args)
    with pytest.raises(ValueError, match="config"):
        paged_prefill(query, *args, config=7)
    with pytest.raises(NotImplementedError, match="head_dim"):  # refused in Python, before the extension
        paged_prefill(query[..., :120].contiguous(), k_cache[..., :120].contiguous(), v_cache[..., :120].contiguous(),
                      *args[2:])
    with pytest.raises(NotImplementedError, match="config"):
        wide = [t.repeat_interleave(2, dim=-1)[..., :160].contiguous() for t in (query, k_cache, v_cache)]
        paged_prefill(*wide, *args[2:], config=0)
