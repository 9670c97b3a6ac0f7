"""On the GPU: decode steps replayed from CUDA graphs compute what the same steps compute eagerly.

- Bit for bit: a padded decode step replayed from its graph gives exactly the logits of the same padded step run
  without a graph, for batch sizes on and between the captured sizes.
- End to end (float32, so that two correct runs cannot pick different tokens by rounding): an engine with graphs
  and asynchronous scheduling gives the tokens of a synchronous engine without graphs, under preemption, prefix-cache hits, aborts, seeded sampling and
  prefill chunks mixed with decodes; and the graphs really served the decode steps.
- On-demand capture adds the smaller sizes mid-run, with the tokens unchanged; so does an engine's default capture
  (each size at its first use), and an engine with no settings takes the automatic sizes of a CUDA device.
- Steps without a graph compute logits for rows padded to a power of two, with the tokens of the same engine
  without padding.
- A capture does not wait for the device: the steps queued before it keep running, and the work queued after it
  runs after its warm-up.
- Batch 1 replays the graph of two rows: neither it nor a one-token prompt step compiles a shape of its own.
- Capture refuses a decode backend that is not capture-safe (torch), with the reason, and the engine still runs.
- The decode kernel with a caller's workspace equals the one that allocates its own.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
from hf_paged import kernels
from hf_paged.runner._step_plan import DecodeColumns

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def _model(dtype: torch.dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="hf_paged", dtype=dtype)
    return model.cuda().eval()


@pytest.fixture(scope="module")
def bf16_model():
    return _model(torch.bfloat16)


@pytest.fixture(scope="module")
def f32_model():
    return _model(torch.float32)


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 200, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("block_size, backend, decode_backend", [(16, None, "cuda"), (256, "flash,cuda", "flash")])
def test_replay_equals_the_same_step_run_eagerly_bit_for_bit(bf16_model, block_size, backend, decode_backend):
    if decode_backend == "flash":
        pytest.importorskip("flash_attn")
    engine = hf_paged.Engine(bf16_model, num_blocks=32768 // block_size, block_size=block_size, max_num_seqs=40,
                             cuda_graphs=[1, 2, 8, 16, 40], backend=backend)
    assert engine.runner.graphs is not None, f"graphs should capture with the {decode_backend} backend"
    assert engine.stats()["decode_backend"] == decode_backend
    for p in _prompts(37, seed=1):
        engine.add_request(p, GenerationConfig(max_new_tokens=50, do_sample=False, eos_token_id=None))
    while engine.scheduler.waiting or any(s.num_generated < 3 for s in engine.scheduler.running):
        engine.step()
    running = list(engine.scheduler.running)
    for seq in running:  # room for the next token, as the scheduler would reserve it
        assert engine.block_manager.reserve_up_to(seq, 1) == 1
    for n in (1, 2, 5, 8, 16, 29, 37):
        seqs = running[:n]
        size = engine.runner.graphs.size_for(seqs, [1] * n)
        assert size == min(s for s in engine.runner.graphs.sizes if s >= n)
        eager = engine.runner.graphs.run_eager(seqs, size)[:n].clone()
        engine.runner.graphs.stage(DecodeColumns.of(seqs), size)
        replayed = engine.runner.graphs.replay(size)[:n].clone()
        assert torch.equal(eager, replayed), f"batch {n} (graph {size}): max diff {(eager - replayed).abs().max()}"


def _run(model, cuda_graphs, prompts, configs, abort_at: dict[int, int] | None = None, **engine_kwargs):
    engine = hf_paged.Engine(model, cuda_graphs=cuda_graphs, **engine_kwargs)
    ids, outs, step = [], {}, 0
    pending = list(zip(prompts, configs))
    while pending or engine.has_unfinished():
        for _ in range(3):  # requests arrive while others decode: mixed prefill + decode steps
            if pending:
                ids.append(engine.add_request(*pending.pop(0)))
        for out in engine.step():
            outs[out.request_id] = out
        step += 1
        for i, at in (abort_at or {}).items():
            if at == step and i < len(ids):
                engine.abort(ids[i])
    return [outs[i] for i in ids], engine


@pytest.mark.parametrize("num_blocks", [1024, 90])  # 90: too few for everything at once, so it preempts
def test_engine_with_graphs_gives_the_tokens_of_the_engine_without(f32_model, num_blocks):
    prefix = _prompts(1, seed=7, lo=40, hi=40)[0]
    prompts = _prompts(10, seed=2, prefix=prefix) + _prompts(14, seed=3, lo=1, hi=60)
    configs = [GenerationConfig(max_new_tokens=30 + i % 7, do_sample=False, eos_token_id=None) for i in range(24)]
    for i in range(0, 24, 4):  # seeded sampling rows too
        configs[i] = GenerationConfig(max_new_tokens=25, do_sample=True, temperature=0.9, top_p=0.9, seed=100 + i,
                                      eos_token_id=None)
    kwargs = dict(num_blocks=num_blocks, block_size=16, max_batch_tokens=256, max_num_seqs=24)
    ref, ref_engine = _run(f32_model, False, prompts, configs, abort_at={5: 12}, async_scheduling=False, **kwargs)
    got, engine = _run(f32_model, True, prompts, configs, abort_at={5: 12}, async_scheduling=True, **kwargs)
    assert engine.runner.graphs is not None and ref_engine.runner.graphs is None
    for i, (a, b) in enumerate(zip(ref, got)):
        if i == 5:  # aborted at the same step; asynchronous scheduling had one more token in flight (dropped)
            assert a.finish_reason == b.finish_reason == "abort"
            assert b.token_ids == a.token_ids[: len(b.token_ids)] and len(b.token_ids) >= len(a.token_ids) - 1
            continue
        assert (a.request_id, a.finish_reason, a.token_ids) == (b.request_id, b.finish_reason, b.token_ids)
    stats = engine.stats()
    assert stats["cuda_graphs"]["replays"] > 20
    assert stats["prefix_cache_hit_tokens"] > 0
    if num_blocks == 90:
        assert stats["preemptions"] > 0
    assert stats["used_blocks"] == 0


def test_eager_steps_pad_their_logits_rows_and_keep_the_tokens(f32_model):
    prompts = _prompts(9, seed=4, lo=1, hi=90)
    configs = [GenerationConfig(max_new_tokens=12 + i % 5, do_sample=False, eos_token_id=None) for i in range(9)]
    kwargs = dict(num_blocks=512, block_size=16, max_batch_tokens=128, max_num_seqs=12, cuda_graphs=False)
    padded, plain = hf_paged.Engine(f32_model, **kwargs), hf_paged.Engine(f32_model, **kwargs)
    assert padded.runner.pad_logits  # (a GPU's default)
    plain.runner.pad_logits = False
    rows = []
    hook = f32_model.lm_head.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[-2]))
    try:
        got = padded.generate(prompts, configs)
    finally:
        hook.remove()
    want = plain.generate(prompts, configs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert rows and set(rows) <= {1, 2, 4, 8, 16}, sorted(set(rows))


def test_on_demand_capture_adds_sizes_as_steps_need_them_and_keeps_the_tokens(f32_model, monkeypatch):
    """``cuda_graph_capture="on_demand"``: nothing at start, the largest size at the first decode step; a smaller
    size is captured mid-run once enough decode steps padded up to a larger graph, between steps with a step in
    flight (asynchronous scheduling), and the tokens stay those of an engine without graphs. A size captured on
    demand replays the same step as its eager run, bit for bit."""
    from hf_paged.runner import _graph_sizes as graph_sizes

    monkeypatch.setattr(graph_sizes, "ON_DEMAND_STEPS", 3)
    prompts = _prompts(16, seed=11, lo=5, hi=120)
    # lengths 4..64: the batch shrinks through every size as the short requests finish
    configs = [GenerationConfig(max_new_tokens=4 + 4 * i, do_sample=False, eos_token_id=None) for i in range(16)]
    kwargs = dict(num_blocks=512, block_size=16, max_batch_tokens=4096, max_num_seqs=16)
    ref, _ = _run(f32_model, False, prompts, configs, async_scheduling=False, **kwargs)
    got, engine = _run(f32_model, [1, 2, 4, 8, 16], prompts, configs, async_scheduling=True,
                       cuda_graph_capture="on_demand", **kwargs)
    assert [(a.finish_reason, a.token_ids) for a in ref] == [(b.finish_reason, b.token_ids) for b in got]
    stats = engine.stats()["cuda_graphs"]
    assert stats["batch_sizes"] == [1, 2, 4, 8, 16] and stats["waiting_sizes"] == []
    assert stats["on_demand_seconds"] > 0 and stats["replays"] > 40

    monkeypatch.setattr(graph_sizes, "ON_DEMAND_STEPS", 10**9)  # nothing captured while it gets going
    fresh = hf_paged.Engine(f32_model, cuda_graphs=[4, 16], cuda_graph_capture="on_demand", **kwargs)
    assert fresh.stats()["cuda_graphs"]["batch_sizes"] == []  # the largest comes at the first decode step
    assert fresh.stats()["cuda_graphs"]["waiting_sizes"] == [4]
    for p in prompts[:3]:
        fresh.add_request(p, GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None))
    while fresh.scheduler.waiting or any(s.num_generated < 2 for s in fresh.scheduler.running):
        fresh.step()
    seqs = list(fresh.scheduler.running)
    for seq in seqs:
        assert fresh.block_manager.reserve_up_to(seq, 1) == 1
    assert fresh.runner.graphs.sizes == [16]
    monkeypatch.setattr(graph_sizes, "ON_DEMAND_STEPS", 3)
    fresh.runner.graphs._waiting.restart(4)  # the steps above counted toward it: count from here
    sizes = [fresh.runner.graphs.size_for(seqs, [1] * 3) for _ in range(3)]
    assert sizes == [16, 16, 4]  # padded up twice, then the third step captures its own size
    eager = fresh.runner.graphs.run_eager(seqs, 4)[:3].clone()
    fresh.runner.graphs.stage(DecodeColumns.of(seqs), 4)
    assert torch.equal(eager, fresh.runner.graphs.replay(4)[:3])


def test_an_engine_captures_at_first_use_by_default_and_keeps_the_tokens(f32_model):
    """With no ``cuda_graph_capture`` an engine (a server's) captures the smallest and the largest size at start and
    each other size at the first decode step that needs it, mid-run with a step in flight; the tokens stay those of
    an engine without graphs."""
    prompts = _prompts(16, seed=12, lo=5, hi=120)
    configs = [GenerationConfig(max_new_tokens=4 + 4 * i, do_sample=False, eos_token_id=None) for i in range(16)]
    kwargs = dict(num_blocks=512, block_size=16, max_batch_tokens=4096, max_num_seqs=16)
    ref, _ = _run(f32_model, False, prompts, configs, async_scheduling=False, **kwargs)
    fresh = hf_paged.Engine(f32_model, cuda_graphs=[1, 2, 4, 8, 16], **kwargs)
    assert fresh.config.cuda_graph_capture == "first_use" and fresh.stats()["cuda_graphs"]["batch_sizes"] == [1, 16]
    assert "cuda_graph_capture" in fresh.stats()["sizing"]
    fresh.close()
    got, engine = _run(f32_model, [1, 2, 4, 8, 16], prompts, configs, async_scheduling=True, **kwargs)
    assert [(a.finish_reason, a.token_ids) for a in ref] == [(b.finish_reason, b.token_ids) for b in got]
    stats = engine.stats()["cuda_graphs"]
    assert stats["batch_sizes"] == [1, 2, 4, 8, 16] and stats["waiting_sizes"] == []
    assert stats["on_demand_seconds"] > 0


def test_an_engine_with_no_settings_takes_the_cuda_rule_and_generate_batch_keeps_the_tokens(bf16_model, f32_model):
    from hf_paged.engine import _sizing as sizing

    engine = hf_paged.Engine(bf16_model)
    rule, stats = sizing.RULES["cuda"], engine.stats()
    free = torch.cuda.mem_get_info()[0]
    if free > 20 * 2**30:  # room for the rule's step whatever else holds the GPU
        assert (stats["max_batch_tokens"], stats["max_num_seqs"]) == (rule.max_batch_tokens, rule.max_num_seqs)
    assert stats["cuda_graphs"]["batch_sizes"] == [2, stats["max_num_seqs"]]
    assert set(stats["sizing"]) == {"max_batch_tokens", "max_num_seqs", "num_blocks", "cuda_graph_capture"}
    engine.close()
    prompts = _prompts(6, seed=13)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    auto = hf_paged.generate_batch(f32_model, prompts, config)  # float32: no rounding tie between two step plans
    fixed = hf_paged.generate_batch(f32_model, prompts, config, hf_paged.EngineConfig(
        max_batch_tokens=2048, max_num_seqs=256, cuda_graphs=False, block_size=16))
    assert [o.generated_tokens for o in auto.values()] == [o.generated_tokens for o in fixed.values()]


def test_one_sequence_replays_the_two_row_graph_and_compiles_no_shape_of_its_own(f32_model):
    """Batch 1 replays the smallest automatic graph (two rows, one of them padding), so an engine's start and its
    decode of one sequence trace no one-token shape of the compiled layers (torch.compile would specialise one), and
    a one-token prompt step (a prompt cached up to its last token) runs the eager modules; the tokens are those of an
    engine without graphs."""
    from torch._dynamo.utils import counters

    prompts = _prompts(1, seed=14, lo=40, hi=60)
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None)
    torch._dynamo.reset()  # forget the one-token shapes other tests compiled
    frames = counters["frames"]["total"]
    engine = hf_paged.Engine(f32_model, num_blocks=256, block_size=16, max_batch_tokens=256, max_num_seqs=8,
                             compile_layers=True)
    assert engine.stats()["compiled_layers"] is True and engine.stats()["cuda_graphs"]["batch_sizes"] == [2, 8]
    at_start = counters["frames"]["total"] - frames
    got = engine.generate(prompts, config)
    assert counters["frames"]["total"] - frames == at_start  # the prompt's step and the decode compiled nothing
    assert engine.stats()["cuda_graphs"]["replays"] >= 22
    assert engine.runner.graphs is not None  # so a one-token step takes the eager modules
    cached = [prompts[0][:33]]  # twice: the repeat's prompt step has one token (32 of 33 cached in blocks of 16)
    once = engine.generate(cached, config)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    twice = engine.generate(cached, config)
    assert engine.stats()["prefix_cache_hit_tokens"] - hits == 32 and twice[0].token_ids == once[0].token_ids
    assert counters["frames"]["total"] - frames == at_start  # that one-token step ran the eager modules
    engine.close()
    # a one-token step run eagerly is a shape of its own: the same count of frames again
    eager = hf_paged.Engine(f32_model, num_blocks=256, block_size=16, max_batch_tokens=256, cuda_graphs=False,
                            compile_layers=True)
    assert [o.token_ids for o in eager.generate(prompts, config)] == [o.token_ids for o in got]
    assert counters["frames"]["total"] - frames >= 2 * at_start
    eager.close()


def test_capture_refuses_a_backend_that_is_not_capture_safe(bf16_model, caplog):
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        engine = hf_paged.Engine(bf16_model, num_blocks=256, block_size=16, max_num_seqs=4, backend="torch")
    assert engine.runner.graphs is None
    assert any("without CUDA graphs" in r.message and "not capture-safe" in r.message for r in caplog.records)
    out = engine.generate([[5, 6, 7, 8]], GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None))
    assert len(out[0].token_ids) == 4
    # "on_demand" finds it at the first decode step, says so as the start does, and decodes eagerly
    lazy = hf_paged.Engine(bf16_model, num_blocks=256, block_size=16, max_num_seqs=4, backend="torch",
                           cuda_graph_capture="on_demand")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        again = lazy.generate([[5, 6, 7, 8]], GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None))
    assert again[0].token_ids == out[0].token_ids and lazy.runner.graphs.sizes == [] and lazy.runner.graphs.stats()["replays"] == 0
    assert any("without CUDA graphs" in r.message and "not capture-safe" in r.message and r.levelname == "INFO"
               for r in caplog.records)


def test_decode_with_a_given_workspace_equals_its_own_allocation():
    torch.manual_seed(3)
    b, h, hkv, d, bs, ctx = 3, 8, 2, 128, 16, 700
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randint(0, 64, (b, 44), device="cuda", dtype=torch.int32)
    lens = torch.tensor([ctx, 17, 512], device="cuda", dtype=torch.int32)
    split = 128
    ws = torch.full((kernels.decode_workspace_numel(b, h, d, 44 * bs, split),), float("nan"), device="cuda")
    own = kernels.paged_decode(q, k, v, tables, lens, d**-0.5, max_seq_len=44 * bs, split_len=split)
    given = kernels.paged_decode(q, k, v, tables, lens, d**-0.5, max_seq_len=44 * bs, split_len=split, workspace=ws)
    assert torch.equal(own, given)
    with pytest.raises(ValueError, match="workspace"):
        kernels.paged_decode(q, k, v, tables, lens, d**-0.5, max_seq_len=44 * bs, split_len=split, workspace=ws[:10])


def test_close_frees_the_captured_graphs(f32_model):
    engine = hf_paged.Engine(f32_model, num_blocks=64, block_size=16, max_batch_tokens=256, max_num_seqs=4)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.stats()["batch_sizes"]
    outputs = engine.generate(_prompts(3, seed=9), GenerationConfig(max_new_tokens=6, do_sample=False))
    assert len(outputs) == 3 and graphs.stats()["replays"] > 0
    engine.close()
    assert engine.runner.graphs is None and engine.stats()["cuda_graphs"] is None
    assert not len(graphs.graphs)  # reset and dropped: nothing holds what they captured
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_a_capture_does_not_wait_for_the_device_and_orders_the_work_after_it(monkeypatch):
    """``CudaGraphs.capture`` neither synchronizes nor empties the allocator's cache (a capture in the middle of a run
    is host work beside the queued steps); its warm-up runs after the work queued before it, the work queued after
    it runs after the warm-up, and the replay computes the step again."""
    from hf_paged.runner._cuda_graphs import CudaGraphs

    x = torch.randn(1 << 22, device="cuda")
    out = torch.empty_like(x)
    x.mul_(0).add_(3)  # queued before the capture: the warm-up must see it

    def step():
        out.copy_(x * 2)
        return out

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: calls.append("empty_cache"))
    graphs = CudaGraphs(torch.device("cuda"))
    assert graphs.capture([("k", step, True)]) is None
    seen = out.clone()  # queued after the capture: runs after its warm-up
    monkeypatch.undo()
    assert calls == []
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full_like(x, 6.0))
    x.fill_(5)
    assert torch.equal(graphs.replay("k"), torch.full_like(x, 10.0))
    graphs.release()
