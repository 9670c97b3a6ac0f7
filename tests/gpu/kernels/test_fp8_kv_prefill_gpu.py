"""On the GPU: the prefill kernel over an fp8 (e4m3) KV cache, against torch.

- Prefill and extend (cached prefixes) through ``paged_prefill`` over an e4m3 cache against float64 attention over
  the *dequantized* cache, judged row by row (tests/helpers/kernel_oracle.py) with the 16-bit kernels' tolerance:
  head_dim 64/128/256, fp16 and bf16, GQA and MQA, block sizes 16 and 48, every compiled tile configuration, prompts
  across 64-key tiles and block edges; kv heads of different magnitudes (0.3x to 3x, so per-head scales differ), sliding
  windows and softcaps (the K scale is folded into both), heads whose K or V scale is 0.
- Unowned cache slots hold ``POISON``, which saturates to +-448 in e4m3: a read past a sequence shows as a large error.
- The cuda backend serves fp8 prefill and extend with the layer's scales; an fp8 engine on CUDA (cuda prefill, decode
  and write) gives the greedy tokens of torch-backend fp8 ``generate`` up to bf16 near-ties.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from greedy_oracle import (assert_matches_up_to_ties, batch, bf16_model,  # noqa: F401 (fixtures)
                           prompts_of, torch_fp8_generate)
from kernel_oracle import assert_rows_close, random_allowance
from paged_steps import POISON, make_paged_step
from transformers import GenerationConfig

import hf_paged
from hf_paged import kernels
from hf_paged.attention import AttentionCall, AttentionInputs, AttentionParams, Dispatcher
from hf_paged.attention.backends._cuda import CudaBackend
from hf_paged.attention.backends._torch import paged_attention_reference
from hf_paged.cache import _kv_quant as kv_quant
from hf_paged.cache._kv_quant import FP8_DTYPE, KVScales
from hf_paged.kernels._prefill import paged_prefill, prefill_configs

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DEVICE = torch.device("cuda")
ROW_TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 8e-3}  # as tests/gpu/kernel_steps.py
# cached prefix lengths, new-token counts: one token; prompts ending on, before and after 64-key tiles and 16/48-token
# blocks; extends after prefixes that end mid-block and mid-tile; a long prefix
SCENARIOS = {
    "one-token": ([0], [1]),
    "ragged-prefill": ([0, 0, 0, 0, 0, 0], [1, 17, 64, 65, 129, 300]),
    "extend-mixed": ([0, 5, 1000, 47, 63], [1, 1, 33, 200, 130]),
    "long-prefix": ([3000, 0], [700, 1]),
}


def fp8_prefill_step(prefix_lens, new_lens, block_size, heads, head_dim, dtype, seed_key):
    """A prefill / extend step over an e4m3 cache whose kv heads differ in magnitude (0.3x to 3x, V the other way
    round), quantized by kv_quant with scales from the owned slots; returns (meta, query, k8, v8, scales) on the GPU.
    Unowned slots hold POISON, saturated to +-448 by the quantization."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr(seed_key).encode()))
    meta, _, _ = make_paged_step(prefix_lens, new_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    magnitude = torch.logspace(-0.5, 0.5, num_kv_heads, device=DEVICE)[:, None]
    scales = KVScales.unset(num_kv_heads, DEVICE)
    quantized = []
    for cache, scale, gain in zip(meta.kv_caches[0], (scales.k, scales.v), (magnitude, magnitude.flip(0))):
        flat = cache.to(DEVICE).flatten(0, 1)
        owned = flat.abs() < POISON / 2
        flat = torch.where(owned, flat * gain, flat)
        kv_quant.fix_unset_scales(scale, torch.where(owned, flat, 0.0))
        quantized.append(kv_quant.quantize(flat, scale).view(cache.shape))
    query = torch.randn(sum(new_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return meta.on(DEVICE), query, *quantized, scales


def dequantized_reference(query, k8, v8, scales: KVScales, meta, params) -> torch.Tensor:
    """float64 attention over the dequantized cache: the kernel's only error left is its own arithmetic."""
    return paged_attention_reference(query.double(), kv_quant.dequantize(k8, scales.k, torch.float64),
                                     kv_quant.dequantize(v8, scales.v, torch.float64), meta, params,
                                     torch.float64).cpu()


def run_fp8(query, k8, v8, scales: KVScales, meta, params, config: int = -1) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # every element must be written
    return paged_prefill(query, k8, v8, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, params.scale,
                         max_seqlen_q=meta.max_seqlen_q, out=out, config=config,
                         window=params.sliding_window or 0, softcap=params.softcap or 0.0, k_scale=scales.k,
                         v_scale=scales.v)


def check_every_config(step, dtype: torch.dtype, head_dim: int, params: AttentionParams, label: str) -> None:
    meta, query, k8, v8, scales = step
    expected = dequantized_reference(query, k8, v8, scales, meta, params)
    allowance = random_allowance(expected, ROW_TOLERANCE[dtype])
    for config in (-1, *prefill_configs(head_dim)):
        out = run_fp8(query, k8, v8, scales, meta, params, config)
        assert_rows_close(out, expected, allowance, f"{label} config {config}")


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("head_dim", kernels.FP8_HEAD_DIMS)
@pytest.mark.parametrize("dtype", kernels.FP8_QUERY_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 48])
def test_fp8_prefill_rows_match_float64_over_the_dequantized_cache(block_size, dtype, head_dim, heads):
    params = AttentionParams(scale=head_dim**-0.5)
    for scenario, (prefix_lens, new_lens) in SCENARIOS.items():
        step = fp8_prefill_step(prefix_lens, new_lens, block_size, heads, head_dim, dtype,
                                (scenario, block_size, dtype, head_dim, heads))
        check_every_config(step, dtype, head_dim, params,
                           f"fp8 {scenario} {dtype} D={head_dim} heads={heads} bs={block_size}")


@pytest.mark.parametrize("window, softcap", [(100, 0.0), (0, 30.0), (700, 50.0), (20, 5.0)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", kernels.FP8_QUERY_DTYPES, ids=["fp16", "bf16"])
def test_fp8_prefill_with_window_and_softcap(dtype, head_dim, window, softcap):
    """Windows inside a tile, across tiles and longer than a prompt; softcaps where scores reach the cap (5) and
    Gemma2's 50. The K scale divides the cap (scores are capped as dequantized scores)."""
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap or None)
    step = fp8_prefill_step([0, 40, 300], [130, 77, 500], 16, (16, 4), head_dim, dtype,
                            ("window", dtype, head_dim, window, softcap))
    if softcap == 5.0:  # queries scaled so that scores reach ~+-10, past the cap
        step = (step[0], step[1] * 4, *step[2:])
    check_every_config(step, dtype, head_dim, params, f"fp8 {dtype} D={head_dim} window {window} softcap {softcap}")


@pytest.mark.parametrize("dtype", kernels.FP8_QUERY_DTYPES, ids=["fp16", "bf16"])
def test_fp8_prefill_heads_with_zero_scales(dtype):
    """A K scale of 0 makes every score 0 (uniform attention over the visible keys, also under a window and a
    softcap, with no NaN from masked keys); a V scale of 0 gives zero output; both 0 (a head never written) too."""
    meta, query, k8, v8, scales = fp8_prefill_step([0, 70], [100, 65], 48, (8, 4), 128, dtype, ("zero", dtype))
    scales.k[0] = 0.0
    scales.v[1] = 0.0
    scales.k[2], scales.v[2] = 0.0, 0.0
    for params in (AttentionParams(scale=128**-0.5), AttentionParams(scale=128**-0.5, sliding_window=30, softcap=5.0)):
        check_every_config((meta, query, k8, v8, scales), dtype, 128, params, f"fp8 zero scales {params}")
        out = run_fp8(query, k8, v8, scales, meta, params)
        assert bool((out[:, 2:6] == 0).all()), "heads whose V scale is 0 must give exact zeros"


@pytest.mark.parametrize("phase_prefix", [[0, 0, 0], [0, 40, 300]], ids=["prefill", "extend"])
def test_cuda_backend_serves_fp8_prefill_and_extend(phase_prefix):
    """The dispatcher picks cuda for an fp8 prefill / extend of a bf16 model, and its forward reads the layer's
    scales (flash refuses fp8 KV at any block size)."""
    meta, query, k8, v8, scales = fp8_prefill_step(phase_prefix, [9, 1, 120], 16, (32, 8), 128, torch.bfloat16,
                                                   ("backend", *phase_prefix))
    call = AttentionCall(meta.phase, "cuda", torch.bfloat16, 128, 32, 8, 16, kv_dtype=FP8_DTYPE)
    assert Dispatcher().select(call).name == "cuda"
    params = AttentionParams(scale=128**-0.5)
    backend = CudaBackend()
    out = backend.forward(AttentionInputs(query, None, None, k8, v8, meta, params, scales), backend.plan(meta))
    expected = dequantized_reference(query, k8, v8, scales, meta, params)
    assert_rows_close(out, expected, random_allowance(expected, ROW_TOLERANCE[torch.bfloat16]), meta.phase.value)


def test_fp8_prefill_refuses_what_is_not_compiled():
    """At most one error thrown from the extension (the GPU box's interpreter has crashed on a third)."""
    meta, query, k8, v8, scales = fp8_prefill_step([0, 3], [5, 9], 16, (4, 2), 64, torch.bfloat16, ("refusals",))
    args = (meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, 0.125)
    kw = dict(k_scale=scales.k, v_scale=scales.v)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        paged_prefill(query.float(), k8, v8, *args, **kw)  # float32 query
    with pytest.raises(NotImplementedError, match="head_dim"):
        paged_prefill(query[..., :32].contiguous(), k8[..., :32].contiguous(), v8[..., :32].contiguous(), *args, **kw)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_prefill(query, k8, v8, *args)
    with pytest.raises(ValueError, match="k_scale must be"):  # the C++ op's own check of the scales
        paged_prefill(query, k8, v8, *args, k_scale=scales.k[:1], v_scale=scales.v)


def test_fp8_engine_prefill_on_cuda_gives_the_tokens_of_torch_fp8_generate(bf16_model, batch):
    """Block size 48 (not a power of two) and eager decode, so this covers what the graph-captured engine of
    test_fp8_kv_gpu.py does not; all prompts fit in the first step, whose write fixes the scales as torch's does."""
    want, gaps = torch_fp8_generate(bf16_model, batch)
    engine = hf_paged.Engine(bf16_model, num_blocks=256, block_size=48, max_batch_tokens=1024, kv_cache_dtype="fp8",
                             cuda_graphs=False)
    outs = engine.generate(prompts_of(batch), GenerationConfig(max_new_tokens=want.shape[1],
                                                             min_new_tokens=want.shape[1], do_sample=False))
    got = torch.tensor([o.token_ids for o in outs], device=DEVICE)
    backends = engine.stats()["backends"]
    assert backends["prefill"] == "cuda" and backends["decode"] == "cuda" and backends["write"] == "cuda", backends
    assert_matches_up_to_ties(got, want, gaps, f"fp8 engine, cuda prefill, block 48: {engine.stats()}")
