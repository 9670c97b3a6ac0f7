"""fp8 (e4m3) KV cache: options, pool sizing, the quantizing write, the torch backend's dequantizing read, and model
quality against the model-dtype cache on a tiny Llama (which backends serve it: test_fp8_kv_backends.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import hf_paged
from hf_paged.attention import AttentionInputs, AttentionParams
from hf_paged.cache import _kv_pool as kv_pool
from hf_paged.cache import _kv_quant as kv_quant
from hf_paged.attention.backends import _torch as torch_backend
from hf_paged.attention.backends._torch import TorchBackend, paged_attention_reference
from hf_paged.cache._kv_quant import FP8_MAX, SCALE_HEADROOM, KVScales
from hf_paged.cache._kv_pool import KVLayout, blocks_for_budget
from paged_steps import random_paged_step
from tiny_models import left_padded_batch, make_config, make_models

FP8 = torch.float8_e4m3fn


def test_invalid_kv_cache_dtype_is_refused_with_the_accepted_values():
    config = make_config("llama_gqa")
    for bad in ("int8", "fp16", torch.float16, "FP8"):
        with pytest.raises(ValueError, match="fp8_e4m3"):
            hf_paged.PagedAttentionCache(config, num_blocks=4, kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="fp8_e4m3"):
            hf_paged.EngineConfig(kv_cache_dtype=bad)
    for same in (None, "auto"):
        assert hf_paged.PagedAttentionCache(config, num_blocks=4, kv_cache_dtype=same).pool.kv_scales is None


def test_fp8_pool_holds_e4m3_and_per_head_scales_and_twice_the_blocks(monkeypatch):
    config = make_config("llama_gqa")  # 2 layers, 2 KV heads of 16
    cache = hf_paged.PagedAttentionCache(config, num_blocks=8, block_size=4, dtype=torch.bfloat16,
                                         kv_cache_dtype="fp8_e4m3")
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in cache.pool.kv_caches)
    assert [tuple(s.k.shape) + tuple(s.v.shape) for s in cache.pool.kv_scales] == [(2, 2)] * 2
    assert cache.stats()["kv_cache_dtype"] == "float8_e4m3fn" and "float8_e4m3fn" in repr(cache)
    layout, devices = KVLayout.from_config(config), [torch.device("cpu")] * 2
    budget = 1_000_000
    monkeypatch.setattr(kv_pool, "free_memory_bytes", lambda device: 8 * budget)  # an eighth of it: the budget
    bf16 = blocks_for_budget(layout, 4, torch.bfloat16, devices, 0.125)
    fp8 = blocks_for_budget(layout, 4, FP8, devices, 0.125)
    assert fp8 == (budget - layout.scale_bytes(FP8)) // layout.bytes_per_block(4, FP8)
    assert 2 * bf16 <= fp8 <= 2 * bf16 + 1
    sized = hf_paged.PagedAttentionCache(config, memory_budget=0.125, block_size=4, dtype=torch.bfloat16,
                                         kv_cache_dtype="fp8")
    assert sized.num_blocks == fp8


def _write(key, value, num_blocks=8, block_size=4, scales=None, slots=None):
    """Write ``key``/``value`` [T, Hkv, D] through the torch backend's KV write into a fresh (or given) fp8 cache."""
    t, hkv, d = key.shape
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    scales = scales or KVScales.unset(hkv, key.device)
    slots = torch.randperm(num_blocks * block_size)[:t] if slots is None else slots
    meta = mock.Mock(slot_mapping=slots, has_padding_slots=False)
    TorchBackend().write_kv(key, value, k_cache, v_cache, meta, kv_scales=scales)
    return k_cache, v_cache, scales, slots


def test_write_then_read_round_trips_each_head_within_e4m3_precision():
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 400.0])  # heads far apart: a transposed head or shared scale fails
    key = torch.randn(24, 4, 32, generator=gen) * magnitudes[None, :, None]
    value = torch.randn(24, 4, 32, generator=gen) * magnitudes.flip(0)[None, :, None]
    k_cache, v_cache, scales, slots = _write(key, value)
    for new, cache, scale in ((key, k_cache, scales.k), (value, v_cache, scales.v)):
        torch.testing.assert_close(scale, new.abs().amax(dim=(0, 2)) * SCALE_HEADROOM / FP8_MAX)
        back = kv_quant.dequantize(cache.view(-1, 4, 32)[slots], scale)
        # e4m3: 3 mantissa bits (relative rounding <= 2^-4) down to 2^-6; below it, steps of 2^-9 (times the scale)
        bound = torch.maximum(new.abs() * 2**-4, scale[None, :, None] * 2**-10)
        assert ((back - new).abs() <= bound * 1.0001).all()


def test_scales_stay_fixed_and_larger_values_saturate_without_nan():
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen)
    k_cache, v_cache, scales, _ = _write(key, value, slots=torch.arange(8))
    first = scales.k.clone()
    big = torch.cat([key * 100, torch.full((1, 2, 16), float("inf"))])
    TorchBackend().write_kv(big, big, k_cache, v_cache, mock.Mock(slot_mapping=torch.arange(8, 17),
                                                                  has_padding_slots=False), kv_scales=scales)
    torch.testing.assert_close(scales.k, first)
    stored = kv_quant.dequantize(k_cache.view(-1, 2, 16)[8:17], scales.k)
    assert torch.isfinite(stored).all()
    torch.testing.assert_close(stored.abs().amax(dim=(0, 2)), first * FP8_MAX)


def _fp8_copy(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float cache [N, bs, Hkv, D] quantized as the write does (scales from its absmax): (fp8 cache, scales)."""
    scale = torch.zeros(cache.shape[2])
    flat = cache.reshape(-1, *cache.shape[2:])
    kv_quant.fix_unset_scales(scale, flat)
    return kv_quant.quantize(flat, scale).view(cache.shape), scale


@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [7, 33, 18]), ([5, 9], [5, 20])])
def test_torch_backend_attention_over_fp8_kv(q_lens, ctx_lens):
    gen = torch.Generator().manual_seed(2)
    query, k_cache, v_cache, meta, _ = random_paged_step(q_lens, ctx_lens, 8, 2, 64, 4, gen)
    (k8, ks), (v8, vs) = _fp8_copy(k_cache), _fp8_copy(v_cache)
    params = AttentionParams(scale=64**-0.5)
    backend = TorchBackend()
    out = backend.forward(AttentionInputs(query, None, None, k8, v8, meta, params, KVScales(ks, vs)), backend.plan(meta))
    # Tight: float64 attention over the dequantized values (only the float32 math differs).
    exact = paged_attention_reference(query.double(), kv_quant.dequantize(k8, ks, torch.float64),
                                      kv_quant.dequantize(v8, vs, torch.float64), meta, params, torch.float64)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6)
    # Loose: against the float32 KV it was quantized from (N(0, 1) Q/K/V, D=64).
    full = paged_attention_reference(query.double(), k_cache, v_cache, meta, params, torch.float64)
    err = (out.double() - full).abs()
    bf16 = (paged_attention_reference(query.double(), k_cache.bfloat16(), v_cache.bfloat16(), meta, params,
                                      torch.float64) - full).abs()
    print(f"\nattention output error, fp8 KV: max {err.max():.4f} mean {err.mean():.4f}; "
          f"bf16 KV: max {bf16.max():.4f} mean {bf16.mean():.4f}")
    assert err.max() < 0.15 and err.mean() < 0.02


def test_compiled_decode_steps_on_an_fp8_cache_give_the_eager_fp8_tokens():
    """generate compiled (fullgraph, CPU, the torch backend) on an fp8 cache: the scales travel through the custom
    ops (set by the prefill, read by every step); the tokens are the eager fp8 cache's, in one graph."""
    from compiled_generate import GREEDY, CountingBackend, compile_config
    from tiny_models import left_padded_batch, make_models

    from hf_paged.hf.compat import with_cache

    torch._dynamo.reset()
    model = make_models("llama_gqa", seed=0)[1]
    gen = torch.Generator().manual_seed(2)
    batch = left_padded_batch([5, 12, 19], gen)

    def run(**cache_kwargs):
        cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=4, kv_cache_dtype="fp8",
                                             **cache_kwargs)
        return model.generate(**with_cache(model, cache, **batch), max_new_tokens=10, **GREEDY), cache

    reference, eager_cache = run()
    backend = CountingBackend()
    model.generation_config.compile_config = compile_config(backend)
    try:
        out, cache = run(max_new_tokens=10, compileable=True)
    finally:
        model.generation_config.compile_config = None
        torch._dynamo.reset()
    assert cache.is_compileable and not eager_cache.is_compileable
    assert torch.equal(out, reference)
    assert backend.graphs == 1 and backend.calls >= 8, "every decode step compiled, in one graph"
    for scales in cache.pool.kv_scales:
        assert (scales.k > 0).all() and (scales.v > 0).all(), "the prefill set every head's scales"


def _teacher_forced_logits(model, dtype, seqs, mask, kv_cache_dtype):
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=128, block_size=4, dtype=dtype,
                                         kv_cache_dtype=kv_cache_dtype)
    with torch.no_grad():
        return model(input_ids=seqs, attention_mask=mask, past_key_values=cache).logits.float()


def _quality(model, dtype, seqs, mask, prompt_width, ref):
    logits = _teacher_forced_logits(model, dtype, seqs, mask, "fp8")
    gen = slice(prompt_width - 1, -1)
    agree = (logits[:, gen].argmax(-1) == ref[:, gen].argmax(-1)).float().mean().item()
    return agree, (logits - ref)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_with_fp8_cache_against_the_model_dtype_cache(dtype):
    """Tiny random Llama (tests/helpers/tiny_models.py "llama_gqa": 2 layers, hidden 64, 4 heads, 2 KV heads of 16)."""
    _, model = make_models("llama_gqa", dtype=dtype)
    batch, new = left_padded_batch([5, 12, 9, 16], torch.Generator().manual_seed(0)), 24
    runs = {}
    for kv in (None, "fp8"):
        cache = hf_paged.PagedAttentionCache(model.config, num_blocks=128, block_size=4, dtype=dtype,
                                             kv_cache_dtype=kv)
        runs[kv] = model.generate(**batch, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)
    width = batch["input_ids"].shape[1]
    free_running = (runs[None][:, width:] == runs["fp8"][:, width:]).float().mean().item()
    # Teacher-forced along the model-dtype cache's greedy tokens: the next-token choice and logits at each position.
    seqs, mask = runs[None], torch.cat([batch["attention_mask"], torch.ones(4, new, dtype=torch.long)], 1)
    ref = _teacher_forced_logits(model, dtype, seqs, mask, None)
    agree, max_diff = _quality(model, dtype, seqs, mask, width, ref)
    print(f"\n{dtype}: free-running greedy agreement {free_running:.3f}; teacher-forced greedy agreement "
          f"{agree:.3f}, max logit difference {max_diff:.4f} (logit std {ref[mask.bool()].std().item():.3f})")
    assert agree >= 0.95 and max_diff < 0.035
    # The bounds catch a broken quantizer: dequantizing with the heads' scales swapped or doubled.
    real = kv_quant.dequantize
    for broken in (lambda s: s.flip(0), lambda s: 2 * s):
        with mock.patch.object(torch_backend, "dequantize", lambda x, s, d=torch.float32: real(x, broken(s), d)):
            assert _quality(model, dtype, seqs, mask, width, ref)[1] > 0.035

