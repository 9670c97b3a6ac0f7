"""Compiled decode steps of plain ``generate`` on ``PagedAttentionCache(..., max_new_tokens=...)``.

transformers compiles the decode forward of a cache whose ``is_compileable`` is True, on CUDA by itself and on the
CPU when the ``compile_config`` says so (``_compile_all_devices``), which is how these tests reach it here. The oracle
is the eager hf_paged path (a cache without ``max_new_tokens``), which other tests hold to eager attention.
"""

from __future__ import annotations

import logging

import pytest
import torch
from compiled_generate import GREEDY, CountingBackend, compile_config
from tiny_models import EOS, PAD, left_padded_batch, make_models
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged.attention import _ops as ops
from hf_paged.attention.backends.base import AttentionInputs, AttentionParams, backend_named
from hf_paged.generate import _static_decode as static_decode
from hf_paged.cache._block_allocator import BlockAllocator
from hf_paged.hf.compat import with_cache

SCENARIOS = {
    "greedy": dict(max_new_tokens=12, **GREEDY),
    "sampling-num_return_sequences": dict(do_sample=True, top_k=20, num_return_sequences=3, max_new_tokens=10,
                                          pad_token_id=PAD, eos_token_id=EOS),
    "return_dict-scores": dict(max_new_tokens=9, return_dict_in_generate=True, output_scores=True, **GREEDY),
    "streamer": dict(max_new_tokens=9, **GREEDY),
}


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.clone())

    def end(self) -> None:
        pass


def _generate(model, cache, batch, kwargs, seed: int, **extra):
    torch.manual_seed(seed)
    return model.generate(**with_cache(model, cache, **batch), **kwargs, **extra)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Every scenario on one model; on the others (a model that builds its mask from a dict of mask kinds, one with two
# kinds, softcapping and a sliding window, and one that reshapes its mask itself) the plainest one.
CASES = [("llama_gqa", s) if s == "greedy" else pytest.param("llama_gqa", s, marks=pytest.mark.slow)
         for s in sorted(SCENARIOS)] + [pytest.param(arch, "greedy", marks=pytest.mark.slow)
                                        for arch in ("qwen2", "gemma2", "gpt2")]  # (each a trace of its own: slow)


@pytest.mark.parametrize(("arch", "scenario"), CASES)
def test_compiled_decode_gives_the_eager_tokens_with_one_graph(arch: str, scenario: str):
    """fullgraph (no graph break), one graph for every decode step (no recompile), eager hf_paged's tokens."""
    seed = len(arch) * 7 + len(scenario)
    _, paged = make_models(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    batch = left_padded_batch(torch.randint(2, 30, (3,), generator=gen).tolist(), gen)
    kwargs = SCENARIOS[scenario]
    want_streamer, got_streamer = Collect(), Collect()
    streams = scenario == "streamer"
    want = _generate(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=128, block_size=4), batch, kwargs,
                     seed, **({"streamer": want_streamer} if streams else {}))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=128, block_size=4,
                                         max_new_tokens=kwargs["max_new_tokens"], compileable=True)
    backend = CountingBackend()
    got = _generate(paged, cache, batch, kwargs, seed, compile_config=compile_config(backend),
                    **({"streamer": got_streamer} if streams else {}))
    if scenario == "return_dict-scores":
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        got = got.sequences
    else:
        assert torch.equal(got, want)
    if streams:
        assert len(got_streamer.chunks) == len(want_streamer.chunks)
        assert all(torch.equal(a, b) for a, b in zip(got_streamer.chunks, want_streamer.chunks))
    decode_steps = got.shape[1] - batch["input_ids"].shape[1] - 1
    assert backend.graphs == 1, "one compiled graph serves every decode step"
    assert backend.calls == decode_steps > 0, "every decode step ran compiled, the prefill eager"


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_inductor_compiles_the_decode_step_and_writes_the_pool_in_place():
    """inductor functionalizes the in-place KV write (store_kv mutates the pool) and must write the pool itself."""
    _, paged = make_models("llama_gqa", seed=31)
    batch = left_padded_batch([7, 3], torch.Generator().manual_seed(31))
    kwargs = dict(max_new_tokens=6, **GREEDY)
    want = _generate(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4), batch, kwargs, 0)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=6, compileable=True)
    backend = CountingBackend("inductor")
    got = _generate(paged, cache, batch, kwargs, 0, compile_config=compile_config(backend))
    assert torch.equal(got, want) and backend.graphs == 1 and backend.calls == got.shape[1] - 7 - 1


def test_beam_search_on_a_compileable_cache_matches_and_shares_blocks():
    """transformers runs beam search eagerly; the fixed-shape decode plan serves it, rows reordered by block table."""
    _, paged = make_models("qwen2", seed=32)
    batch = left_padded_batch([5, 12], torch.Generator().manual_seed(32))
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, early_stopping=True, **GREEDY)
    want = _generate(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=128, block_size=4), batch, kwargs, 0)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=128, block_size=4, max_new_tokens=8,
                                         compileable=True)
    got = _generate(paged, cache, batch, kwargs, 0, compile_config=compile_config(CountingBackend()))
    assert torch.equal(got, want)
    tables = cache.rows.tables
    assert any(a[0] == b[0] for i, a in enumerate(tables) for b in tables[i + 1:]), "beams share prompt blocks"


def test_blocks_are_taken_before_decoding_and_decode_steps_never_allocate(monkeypatch):
    _, paged = make_models("llama_gqa", seed=33)
    batch = left_padded_batch([6, 17, 1], torch.Generator().manual_seed(33))
    forwards, allocations = [], []
    paged.register_forward_pre_hook(lambda *args: forwards.append(1))
    allocate = BlockAllocator.allocate
    monkeypatch.setattr(BlockAllocator, "allocate",
                        lambda self, n=1: allocations.append((len(forwards), n)) or allocate(self, n))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4, max_new_tokens=20,
                                         compileable=True)
    _generate(paged, cache, batch, dict(max_new_tokens=20, **GREEDY), 0)
    assert len(forwards) == 20
    assert {f for f, _ in allocations} == {0}, "every block was taken before the first forward ran"
    # Each row: its prompt plus 20 tokens, in 4-token blocks.
    assert sum(n for _, n in allocations) == sum(-(-(n + 20) // 4) for n in (6, 17, 1))


def test_out_of_blocks_is_raised_before_the_first_forward_with_the_blocks_needed():
    _, paged = make_models("llama_gqa", seed=34)
    batch = left_padded_batch([6, 9], torch.Generator().manual_seed(34))
    forwards = []
    paged.register_forward_pre_hook(lambda *args: forwards.append(1))
    needed = -(-(6 + 40) // 4) + -(-(9 + 40) // 4)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=needed - 1, block_size=4, max_new_tokens=40,
                                         compileable=True)
    with pytest.raises(hf_paged.OutOfBlocksError, match="max_new_tokens=40") as err:
        _generate(paged, cache, batch, dict(max_new_tokens=40, **GREEDY), 0)
    assert err.value.needed == needed and not forwards
    assert cache.stats()["blocks_used"] == 0


def test_a_longer_generate_than_the_cache_was_told_still_matches(caplog):
    """Rows outgrowing the reservation widen the table (a warning: a compiled step would recompile), not fail."""
    _, paged = make_models("llama_gqa", seed=35)
    batch = left_padded_batch([3, 8], torch.Generator().manual_seed(35))
    kwargs = dict(max_new_tokens=14, **GREEDY)
    want = _generate(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4), batch, kwargs, 0)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4, max_new_tokens=2,
                                         compileable=True)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        got = _generate(paged, cache, batch, kwargs, 0)
    assert torch.equal(got, want)
    assert "outgrew the decode block table" in caplog.text


def test_is_compileable_and_why_not(caplog):
    config = make_models("llama_gqa", seed=36)[1].config
    make = hf_paged.PagedAttentionCache
    static_decode._note_not_compileable.cache_clear()  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert not make(config, num_blocks=8).is_compileable
        assert "not given max_new_tokens" in caplog.text
        caplog.clear()
        cpu = make(config, num_blocks=8, max_new_tokens=4)
        assert not cpu.is_compileable and not cpu.is_compileable
        assert caplog.text.count("on cpu: transformers compiles generate's decode step on CUDA") == 1
        assert cpu.compile_mode.reason.startswith("the KV cache is on cpu")
        assert not make(config, num_blocks=8, max_new_tokens=4, compileable=False).is_compileable
    assert make(config, num_blocks=8, max_new_tokens=4, compileable=True).is_compileable
    assert all(layer.is_compileable for layer in make(config, num_blocks=8, max_new_tokens=4, compileable=True).layers)
    with pytest.raises(ValueError, match="not given max_new_tokens"):
        make(config, num_blocks=8, compileable=True)
    with pytest.raises(ValueError, match="several devices"):
        make(config, num_blocks=8, max_new_tokens=4, compileable=True, device=["cpu", "meta"])
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        make(config, num_blocks=8, max_new_tokens=0)


def test_a_cpu_cache_is_not_compiled_by_generate_unless_asked():
    """is_compileable False on the CPU by default: generate runs eagerly even with a compile_config."""
    _, paged = make_models("llama_gqa", seed=37)
    batch = left_padded_batch([4, 6], torch.Generator().manual_seed(37))
    backend = CountingBackend()
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=5)
    _generate(paged, cache, batch, dict(max_new_tokens=5, **GREEDY), 0, compile_config=compile_config(backend))
    assert backend.graphs == 0
    forced = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=5,
                                          compileable=True)
    _generate(paged, forced, batch, dict(max_new_tokens=5, **GREEDY), 0, compile_config=compile_config(backend),
              disable_compile=True)
    assert backend.graphs == 0, "disable_compile is honoured"


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_custom_ops_match_the_backend_and_pass_opcheck(phase: str):
    torch.manual_seed(38)
    num_blocks, bs, hkv, heads, dim = 6, 4, 2, 4, 16
    k_cache, v_cache = torch.randn(num_blocks, bs, hkv, dim), torch.randn(num_blocks, bs, hkv, dim)
    lens = [5, 9]
    q_lens = [1, 1] if phase == "decode" else lens
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32)
    slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs
                          for b, (n, q) in enumerate(zip(lens, q_lens)) for p in range(n - q, n)])
    tokens = sum(q_lens)
    query, key, value = torch.randn(tokens, heads, dim), torch.randn(tokens, hkv, dim), torch.randn(tokens, hkv, dim)
    cu_q = torch.tensor([0, q_lens[0], tokens], dtype=torch.int32)
    cu_k = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    torch.library.opcheck(torch.ops.hf_paged.store_kv, (key, value, k_cache.clone(), v_cache.clone(), slots,
                                                         "torch", False))
    # The fp8 write: schema checking compares mutated tensors arithmetically, which CPU fp8 lacks; the fake-tensor
    # and AOT checks (what the compiler runs; torch 2.11 failed them on mutated None scales) stay.
    fp8 = torch.float8_e4m3fn
    torch.library.opcheck(torch.ops.hf_paged.store_kv_fp8, (key, value, k_cache.to(fp8), v_cache.to(fp8), slots,
                                                             "torch", False, torch.zeros(hkv), torch.ones(hkv)),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    args = (query, key, value, k_cache, v_cache, cu_q, cu_k, seq_lens, tables, phase, max(q_lens), max(lens),
            "torch", dim**-0.5, None, None)
    torch.library.opcheck(torch.ops.hf_paged.paged_attention, args)
    # Through the op, the same numbers as the backend called directly.
    from hf_paged.attention._metadata import build_metadata

    meta = build_metadata(q_lens=torch.tensor(q_lens), seq_lens_k=seq_lens, block_tables=tables, slot_mapping=slots,
                          token_index=None, grid=(tokens, 1), block_size=bs,
                          device=torch.device("cpu"))
    torch_backend, params = backend_named("torch"), AttentionParams(scale=dim**-0.5)
    direct_k, direct_v = k_cache.clone(), v_cache.clone()
    torch_backend.write_kv(key, value, direct_k, direct_v, meta)
    ops.store_kv(key, value, k_cache, v_cache, meta, torch_backend)
    assert torch.equal(k_cache, direct_k) and torch.equal(v_cache, direct_v)
    want = torch_backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params),
                                 torch_backend.plan(meta))
    assert torch.equal(ops.paged_attention(query, key, value, k_cache, v_cache, meta, torch_backend, params), want)


def test_later_calls_and_new_caches_of_the_same_shapes_reuse_the_graph():
    _, paged = make_models("llama_gqa", seed=39)
    batch = left_padded_batch([5, 11], torch.Generator().manual_seed(39))
    kwargs = dict(max_new_tokens=6, **GREEDY)
    backend = CountingBackend()
    config = compile_config(backend)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=6,
                                         compileable=True)
    outs = [_generate(paged, cache, batch, kwargs, 0, compile_config=config) for _ in range(2)]
    other = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=6,
                                         compileable=True)
    outs.append(_generate(paged, other, batch, kwargs, 0, compile_config=config))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert backend.graphs == 1 and backend.calls == 3 * (6 - 1)


def test_a_compiled_forward_without_a_plan_says_what_to_do():
    """Compiling a forward whose mask is a padding mask (no plan made before the call) fails with the reason, never
    falls back to dense attention."""
    _, paged = make_models("llama_gqa", seed=40)
    batch = left_padded_batch([4, 6], torch.Generator().manual_seed(40))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4)
    forward = torch.compile(paged.forward, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="must get its step planned beforehand"):
        forward(**with_cache(paged, cache, **batch))


def test_torch_compile_of_model_forward_in_a_hand_written_decode_loop():
    """Outside generate: plan each step with transformers' create_masks_for_generate (eager, as generate does for a
    compileable cache), then call ``torch.compile(model.forward, fullgraph=True)``; greedy tokens equal generate's."""
    from transformers.masking_utils import create_masks_for_generate

    _, paged = make_models("qwen3", seed=41)
    batch = left_padded_batch([3, 10, 7], torch.Generator().manual_seed(41))
    steps = 6
    want = paged.generate(**with_cache(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4),
                                       **batch), max_new_tokens=steps, **GREEDY)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4, max_new_tokens=steps,
                                         compileable=True)
    backend = CountingBackend()
    forward = torch.compile(paged.forward, fullgraph=True, backend=backend)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens, finished = ids, torch.zeros(ids.shape[0], 1, dtype=torch.bool)
    with torch.no_grad():
        for step in range(steps):
            embeds = torch.empty(ids.shape[0], ids.shape[1], 0)
            plan = create_masks_for_generate(config=paged.config, inputs_embeds=embeds, attention_mask=mask,
                                             **with_cache(paged, cache), position_ids=positions)
            run = paged.forward if step == 0 else forward  # the prefill stays eager
            logits = run(input_ids=ids, attention_mask=plan, position_ids=positions,
                         **with_cache(paged, cache)).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.where(finished, PAD, ids)  # as generate: a row past EOS gets padding
            finished |= ids == EOS
            tokens = torch.cat([tokens, ids], 1)
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
            positions = positions[:, -1:] + 1
    assert torch.equal(tokens, want)
    assert backend.graphs == 1 and backend.calls == steps - 1
