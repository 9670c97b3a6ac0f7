"""On the GPU: an fp8 (e4m3) KV cache through the CUDA kernels, against torch.

- Decode: ``paged_decode`` over an e4m3 cache against float64 attention over the *dequantized* cache, so the only
  error left is the kernel's own arithmetic (fp16/bf16 products and probabilities, float32 sums), judged row by row
  with the 16-bit kernels' tolerance; contexts on and around block and split edges, GQA / MQA / MHA, per-head
  scales of different magnitudes, a sliding window and a softcap (the K scale is folded into both).
- Write: ``write_kv`` into an e4m3 cache gives torch's quantizing write (kv_quant.py) byte for byte, fixes unset
  scales as it does, skips -1 slots, and replays from a CUDA graph.
- Engine: an fp8 engine on CUDA (cuda prefill, cuda decode and write in CUDA graphs) gives the greedy tokens of
  torch-backend fp8 ``generate`` up to bf16 near-ties; its graph replays equal the same steps run eagerly. The
  prefill kernel's own fp8 checks are in test_fp8_kv_prefill_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from greedy_oracle import (NEW_TOKENS, assert_matches_up_to_ties, batch, bf16_model,  # noqa: F401 (fixtures)
                           prompts_of, torch_fp8_generate)
from kernel_oracle import assert_rows_close, random_allowance
from kernel_rows import DECODE_LENS, seeded
from paged_steps import random_paged_step
from transformers import GenerationConfig

import hf_paged
from hf_paged import kernels
from hf_paged.runner._step_plan import DecodeColumns
from hf_paged.attention import AttentionParams
from hf_paged.attention._metadata import PagedMetadata, Phase
from hf_paged.attention.backends._torch import TorchBackend, paged_attention_reference
from hf_paged.cache import _kv_quant as kv_quant
from hf_paged.cache._kv_quant import FP8_DTYPE, KVScales
from hf_paged.hf.compat import with_cache

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DEVICE = torch.device("cuda")
ROW_TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 8e-3}  # as tests/gpu/kernel_steps.py


def quantized_step(lens: list[int], block_size: int, heads: tuple[int, int], head_dim: int, seed_key: tuple):
    """A decode step over random K/V whose kv heads differ in magnitude (0.3x to 3x), quantized to e4m3 by
    kv_quant with per-head scales; returns (query float32, k8, v8, scales, meta), all on the CPU."""
    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, meta, _ = random_paged_step([1] * len(lens), lens, num_heads, num_kv_heads, head_dim,
                                                         block_size, seeded(*seed_key))
    magnitude = torch.logspace(-0.5, 0.5, num_kv_heads)
    k_cache, v_cache = k_cache * magnitude[:, None], v_cache * magnitude.flip(0)[:, None]
    scales = KVScales.unset(num_kv_heads, torch.device("cpu"))
    quantized = []
    for cache, scale in ((k_cache, scales.k), (v_cache, scales.v)):
        flat = cache.flatten(0, 1)
        kv_quant.fix_unset_scales(scale, flat)
        quantized.append(kv_quant.quantize(flat, scale).view(cache.shape))
    return query, *quantized, scales, meta


def check_fp8_decode(dtype: torch.dtype, head_dim: int, heads: tuple[int, int], block_size: int,
                     split_lens: tuple[int, ...], window: int = 0, softcap: float = 0.0) -> None:
    query, k8, v8, scales, meta = quantized_step(DECODE_LENS, block_size, heads, head_dim,
                                                 (dtype, head_dim, heads, block_size, window, softcap))
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap or None)
    meta, q, k8, v8 = meta.on(DEVICE), query.to(DEVICE, dtype), k8.to(DEVICE), v8.to(DEVICE)
    k_scale, v_scale = scales.k.to(DEVICE), scales.v.to(DEVICE)
    expected = paged_attention_reference(q.double(), kv_quant.dequantize(k8, k_scale, torch.float64),
                                         kv_quant.dequantize(v8, v_scale, torch.float64), meta, params,
                                         torch.float64).cpu()
    allowance = random_allowance(expected, ROW_TOLERANCE[dtype])
    for split_len in split_lens:
        for max_seq_len in (meta.max_seqlen_k, meta.block_tables.shape[1] * block_size):
            out = torch.full_like(q, float("nan"))
            kernels.paged_decode(q, k8, v8, meta.block_tables, meta.seq_lens_k, params.scale, max_seq_len=max_seq_len,
                                 out=out, split_len=split_len, window=window, softcap=softcap, k_scale=k_scale,
                                 v_scale=v_scale)
            assert_rows_close(out, expected, allowance, f"fp8 decode {dtype} D={head_dim} heads={heads} "
                                                        f"bs={block_size} split {split_len} max_seq_len {max_seq_len} "
                                                        f"window {window} softcap {softcap}")


@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (4, 4)], ids=["gqa-32/8", "mqa-8/1", "mha-4/4"])
@pytest.mark.parametrize("head_dim", kernels.FP8_HEAD_DIMS)
@pytest.mark.parametrize("dtype", kernels.FP8_QUERY_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 48])
def test_fp8_decode_rows_match_float64_over_the_dequantized_cache(block_size, dtype, head_dim, heads):
    check_fp8_decode(dtype, head_dim, heads, block_size, split_lens=(0, 64, 192, 512))


@pytest.mark.parametrize("window, softcap", [(100, 0.0), (0, 30.0), (700, 50.0)])
@pytest.mark.parametrize("dtype", kernels.FP8_QUERY_DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_with_window_and_softcap(dtype, window, softcap):
    check_fp8_decode(dtype, 128, (16, 4), 16, split_lens=(0, 64), window=window, softcap=softcap)


def test_fp8_decode_refuses_float32_queries_and_other_head_dims():
    query, k8, v8, scales, meta = quantized_step([5, 9], 16, (4, 2), 64, ("refusals",))
    meta, k8, v8 = meta.on(DEVICE), k8.to(DEVICE), v8.to(DEVICE)
    args = (k8, v8, meta.block_tables, meta.seq_lens_k, 0.125)
    scale_kw = dict(k_scale=scales.k.to(DEVICE), v_scale=scales.v.to(DEVICE))
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        kernels.paged_decode(query.to(DEVICE), *args, **scale_kw)  # float32 query
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        kernels.paged_decode(query.to(DEVICE, torch.bfloat16), *args)
    with pytest.raises(ValueError, match="k_scale must be"):  # the C++ op's own check of the scales
        kernels.paged_decode(query.to(DEVICE, torch.bfloat16), *args, k_scale=scale_kw["k_scale"][:1],
                             v_scale=scale_kw["v_scale"])


def _write_inputs(dtype: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-1, 1, num_kv_heads)[:, None]
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) / magnitude).to(dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows: neither written nor counted in a scale
    return key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)


def _torch_write(key, value, k8, v8, slots, scales: KVScales) -> None:
    meta = PagedMetadata(
        num_seqs=0, num_tokens=key.shape[0], max_seqlen_q=0, max_seqlen_k=0, block_size=k8.shape[1],
        phase=Phase.DECODE, cu_seqlens_q=slots, cu_seqlens_k=slots, seq_lens_k=slots,
        block_tables=slots, slot_mapping=slots, token_index=None, grid=(1, key.shape[0]), has_padding_slots=True)
    TorchBackend().write_kv(key, value, k8, v8, meta, kv_scales=scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_fp8_write_equals_the_torch_write_byte_for_byte(dtype, head_dim):
    caches = {name: [torch.zeros(64, 16, 4, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
              for name in ("cuda", "torch")}
    scales = {name: KVScales.unset(4, DEVICE) for name in caches}
    # The first write fixes the scales; the second, 8x larger, saturates values past 4x the first write's absmax.
    for step, gain in enumerate((1.0, 8.0)):
        key, value, slots = _write_inputs(dtype, 77, 4, head_dim, seed=step)
        key, value = key * gain, value * gain
        kernels.write_kv(key, value, *caches["cuda"], slots, k_scale=scales["cuda"].k, v_scale=scales["cuda"].v)
        _torch_write(key, value, *caches["torch"], slots, scales["torch"])
        torch.testing.assert_close(scales["cuda"].k, scales["torch"].k, rtol=1e-6, atol=0)
        torch.testing.assert_close(scales["cuda"].v, scales["torch"].v, rtol=1e-6, atol=0)
        for ours, theirs in zip(caches["cuda"], caches["torch"]):
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), f"step {step}"
    assert bool((scales["cuda"].k > 0).all() and (scales["cuda"].v > 0).all())


def test_fp8_write_replays_from_a_cuda_graph():
    k8, v8 = (torch.zeros(64, 16, 2, 128, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2))
    scales = KVScales.unset(2, DEVICE)
    key, value, slots = _write_inputs(torch.bfloat16, 9, 2, 128, seed=5)
    slots[0] = -1
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.write_kv(key, value, k8, v8, slots, k_scale=scales.k, v_scale=scales.v)  # warm-up (fixes scales)
        with torch.cuda.graph(graph, stream=stream):
            kernels.write_kv(key, value, k8, v8, slots, k_scale=scales.k, v_scale=scales.v)
    torch.cuda.current_stream().wait_stream(stream)
    new_key, new_value, new_slots = _write_inputs(torch.bfloat16, 9, 2, 128, seed=6)
    key.copy_(new_key), value.copy_(new_value), slots.copy_(new_slots)
    graph.replay()
    ref = [torch.zeros_like(k8), torch.zeros_like(v8)]
    ref_scales = KVScales(scales.k.clone(), scales.v.clone())
    _torch_write(key, value, *ref, slots, ref_scales)
    keep = slots[slots >= 0]
    for ours, theirs in zip((k8, v8), ref):
        flat_ours, flat_theirs = ours.view(torch.uint8).flatten(0, 1), theirs.view(torch.uint8).flatten(0, 1)
        assert torch.equal(flat_ours[keep], flat_theirs[keep])


def test_fp8_engine_on_cuda_gives_the_tokens_of_torch_fp8_generate(bf16_model, batch):
    prompts = prompts_of(batch)
    want, gaps = torch_fp8_generate(bf16_model, batch)

    engine = hf_paged.Engine(bf16_model, num_blocks=512, block_size=16, max_batch_tokens=1024, kv_cache_dtype="fp8")
    assert engine.runner.graphs is not None, "an fp8 engine on CUDA should capture its decode steps"
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                               do_sample=False))
    got = torch.tensor([o.token_ids for o in outs], device=DEVICE)
    stats = engine.stats()
    backends = engine.stats()["backends"]
    assert backends["decode"] == "cuda" and backends["write"] == "cuda" and backends["prefill"] == "cuda", backends
    assert stats["cuda_graphs"]["replays"] > 0, stats["cuda_graphs"]
    assert_matches_up_to_ties(got, want, gaps, f"fp8 engine on cuda, stats={stats}")


def test_fp8_graph_replay_equals_the_same_step_run_eagerly(bf16_model, batch):
    engine = hf_paged.Engine(bf16_model, num_blocks=1024, block_size=16, max_num_seqs=16, cuda_graphs=[1, 4, 16],
                             kv_cache_dtype="fp8")
    assert engine.runner.graphs is not None
    for p in prompts_of(batch):
        engine.add_request(p, GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None))
    while engine.scheduler.waiting or any(s.num_generated < 3 for s in engine.scheduler.running):
        engine.step()
    running = list(engine.scheduler.running)
    for seq in running:
        assert engine.block_manager.reserve_up_to(seq, 1) == 1
    for n in (1, 3, len(running)):
        seqs = running[:n]
        size = engine.runner.graphs.size_for(seqs, [1] * n)
        eager = engine.runner.graphs.run_eager(seqs, size)[:n].clone()
        engine.runner.graphs.stage(DecodeColumns.of(seqs), size)
        replayed = engine.runner.graphs.replay(size)[:n].clone()
        assert torch.equal(eager, replayed), f"batch {n} (graph {size}): max diff {(eager - replayed).abs().max()}"


def test_fp8_compiled_generate_gives_the_tokens_of_torch_fp8_generate(bf16_model, batch):
    """generate compiles its decode steps (CUDA graphs) on an fp8 cache by itself: the layer scales travel through
    the custom ops to the cuda decode and write; greedy tokens are the torch-backend fp8 cache's up to bf16 ties."""
    from torch._dynamo.utils import counters

    want, gaps = torch_fp8_generate(bf16_model, batch)
    torch._dynamo.reset()
    counters.clear()
    compiled = hf_paged.PagedAttentionCache(bf16_model.config, num_blocks=512, block_size=16, device="cuda",
                                            dtype=torch.bfloat16, kv_cache_dtype="fp8", max_new_tokens=NEW_TOKENS)
    assert compiled.is_compileable, compiled.compile_mode.reason
    outs = [bf16_model.generate(**with_cache(bf16_model, compiled, **batch), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, eos_token_id=None) for _ in range(2)]
    assert torch.equal(outs[0], outs[1]), "a second call (replaying the graphs) gives the first call's tokens"
    assert compiled.stats()["backends"]["decode"] == "cuda", compiled.stats()["backends"]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["inductor"].get("cudagraph_skips")
    assert_matches_up_to_ties(outs[0][:, batch["input_ids"].shape[1]:], want, gaps, "fp8 compiled generate")
