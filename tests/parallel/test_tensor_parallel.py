"""Tensor parallel on the CPU: a tiny float32 Llama saved once, loaded with ``tp_plan="auto"`` in two processes over
gloo. Each rank's pool holds its own KV heads; ``Engine``, ``generate_batch`` and ``model.generate`` with
``paged_cache_for`` return on both ranks the tokens one process returns; a bad prompt, prompts that differ between
the ranks and a failure inside one rank's step end both ranks with the same error; a failure inside one rank's
forward ends with a timeout message instead of a hang."""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import random
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import EOS, PAD, VOCAB, left_padded_batch, make_models
from transformers import AutoModelForCausalLM, GenerationConfig

from hf_paged._forward_context import forward_context
import hf_paged
from hf_paged import envs
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.compile._layers import DYNAMO_DEFAULTS
from hf_paged.parallel import _fuse_all_reduce as fusion
from hf_paged.parallel import _linears as tp_linears
from hf_paged.parallel._tensor_parallel import tensor_parallel
from hf_paged.kernels import _skinny as skinny
from hf_paged.parallel._tensor_parallel import kv_layout, tensor_parallel

WORLD_SIZE = 2
DEADLINE_S = 240  # a rank left waiting shows up as this timeout, not as a stuck test run
STUCK_EXIT = 17  # rank 1's exit code after the forward-failure scenario (rank 0 is then stuck, and killed)


def _prompts(seed: int, n: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


def _greedy(**extra) -> GenerationConfig:
    return GenerationConfig(**{**GREEDY, **extra})


def _greedy_logprobs() -> GenerationConfig:
    return _greedy(output_scores=True)  # the engine returns each token's logprob


def _sampled(seed: int | None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=6, do_sample=True, top_k=20, seed=seed, pad_token_id=PAD,
                            eos_token_id=EOS)


def _engine(model) -> hf_paged.Engine:
    """A pool small enough that the prompts preempt each other, steps small enough to chunk their prefills."""
    return hf_paged.Engine(model, num_blocks=24, block_size=8, max_batch_tokens=32, max_num_seqs=6)


def _outcome(call):
    try:
        return "ok", call()
    except Exception as exc:  # the scenarios' expected failures are compared by the parent
        return "error", type(exc).__name__, str(exc)


def _tokens(results) -> list[list[int]]:
    return [list(o.generated_tokens) for o in results.values()]


def _worker(rank: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), HF_PAGED_TP_TIMEOUT_S="60")
    torch.set_num_threads(1)
    from hf_paged.integrations.accelerate import paged_cache_for

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="hf_paged",
                                                 dtype=torch.float32).eval()
    prompts = _prompts(0)
    # A sharded linear of a style hf_paged does not compile (here: an unreadable wrapper) refuses compile_layers=True
    # and changes nothing; run first, before anything installs the local linears.
    down = model.model.layers[0].mlp.down_proj
    tp_forward = down.forward
    down.forward = functools.partial(tp_forward)
    refused = _outcome(lambda: hf_paged.Engine(model, num_blocks=8, compile_layers=True))
    down.forward = tp_forward
    sized = hf_paged.Engine(model, num_blocks=None, memory_budget=1e-6, block_size=8)
    record = {
        "compile_refused": (refused, tp_linears.installed(model)),
        "kv_heads": (kv_layout(model).num_kv_heads, sized.runner.pool.kv_caches[0][0].shape[2]),
        "sized_blocks": sized.runner.pool.num_blocks,
        "graphs": sized.stats()["cuda_graphs"],
    }
    del sized
    record["engine"] = _outcome(lambda: [o.token_ids for o in _engine(model).generate(prompts, _greedy())])
    record["seeded"] = _outcome(lambda: [o.token_ids for o in _engine(model).generate(prompts, _sampled(5))])
    torch.manual_seed(100 + rank)  # unseeded requests draw different seeds on each rank
    record["unseeded"] = _outcome(lambda: [o.token_ids for o in _engine(model).generate(prompts, _sampled(None))])
    record["generate_batch"] = _outcome(lambda: _tokens(hf_paged.generate_batch(model, prompts, _greedy())))
    record["persistent"] = _outcome(lambda: [_tokens(hf_paged.generate_batch(
        model, prompts[:k], _greedy(), persistent_manager=True)) for k in (4, 3)])  # the second reuses the engine
    batch = left_padded_batch([5, 17, 30], torch.Generator().manual_seed(2))
    record["generate"] = _outcome(lambda: model.generate(
        **batch, past_key_values=paged_cache_for(model, memory_budget=1e-5, block_size=8), **GREEDY
    ).tolist())
    bad = [p if i != 4 else [VOCAB + 5] for i, p in enumerate(prompts)]
    record["bad_prompt"] = _outcome(lambda: hf_paged.generate_batch(model, bad, _greedy()))
    differ = [p[:-1] + [(p[-1] + rank) % VOCAB] if i == 6 else p for i, p in enumerate(prompts)]  # same lengths
    record["different_prompts"] = _outcome(lambda: hf_paged.generate_batch(model, differ, _greedy()))
    record["compiled"] = _outcome(lambda: _compiled_run(model, prompts))
    record["compiled_fused"] = _outcome(lambda: _fused_run(model, prompts))
    record["sharded_logits"] = _outcome(lambda: _sharded_logits_run(model, prompts))
    engine = _engine(model)
    if rank == 1:  # fails after the step's collectives, in the hand-over of its tokens
        send, calls = engine._receiver.send, []
        engine._receiver.send = lambda *a: (calls.append(1), send(*a))[1] if len(calls) < 3 else _raise()
    record["failed_step"] = _outcome(lambda: engine.generate(prompts, _greedy()))
    record["after_failed_step"] = _outcome(lambda: engine.generate(prompts[:1], _greedy()))
    record["after_failures"] = _outcome(lambda: _tokens(hf_paged.generate_batch(model, prompts[:3], _greedy())))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)
    # Last: rank 1 fails inside its forward, before the layers' first all-reduce; rank 0 waits in that all-reduce.
    os.environ["HF_PAGED_TP_TIMEOUT_S"] = "3"
    envs.refresh()
    engine = _engine(model)
    if rank == 1:
        model.model.embed_tokens.forward = lambda *a, **k: _raise()
    stuck = _outcome(lambda: engine.generate(prompts[:2], _greedy()))
    with open(os.path.join(out_dir, f"rank{rank}_stuck.pkl"), "wb") as f:
        pickle.dump(stuck, f)
    os._exit(STUCK_EXIT)


def _sharded_logits_run(model, prompts) -> tuple:
    """The engine's logits left sharded over the vocabulary: its greedy, seeded-sampling, logprob and min_new_tokens
    tokens (and the logprobs), how many steps took the (value, id) exchange and how many gathered, and the lm_head's
    own path restored afterwards."""
    from hf_paged.parallel import _logits as tp_logits

    argmaxes, gathers = [], []
    argmax, gather = tp_logits.VocabShards.argmax, tp_logits.VocabShards.gather
    tp_logits.VocabShards.argmax = lambda self, x: (argmaxes.append(x.shape), argmax(self, x))[1]
    tp_logits.VocabShards.gather = lambda self, x: (gathers.append(x.shape), gather(self, x))[1]
    head = model.lm_head
    try:
        engine = _engine(model)
        greedy = [o.token_ids for o in engine.generate(prompts, _greedy())]
        greedy_steps = len(argmaxes)
        seeded = [o.token_ids for o in engine.generate(prompts, _sampled(5))]
        logprobs = [(o.token_ids, o.logprobs) for o in engine.generate(prompts[:3], _greedy_logprobs())]
        held = [o.token_ids for o in engine.generate(prompts[:3], _greedy(min_new_tokens=8))]
        widths = {shape[-1] for shape in argmaxes + gathers}
        local = isinstance(head.__dict__.get("forward"), tp_logits.LocalLogits)
    finally:
        tp_logits.VocabShards.argmax, tp_logits.VocabShards.gather = argmax, gather
        if isinstance(head.__dict__.get("forward"), tp_logits.LocalLogits):
            head.forward = head.forward.eager  # transformers' own gathered head for the parts after this one
    return greedy, seeded, logprobs, held, greedy_steps > 0, len(gathers) > 0, widths, local


def _compiled_run(model, prompts) -> tuple:
    """The engine with compiled layers: its tokens, whether the compiled code served, how many linears run as local
    products, what dynamo traced for one layer's MLP (the all-reduce op, no DTensor), which layouts the shards lie
    in, and whether every compiled forward knows its model is tensor-parallel (PDL by default there)."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    engine = hf_paged.Engine(model, num_blocks=24, block_size=8, max_batch_tokens=32, max_num_seqs=6,
                             compile_layers=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokens = [o.token_ids for o in engine.generate(prompts, _greedy())]
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    served = (engine.runner.compiled is not None and engine.runner.compiled.enabled
              and compiled >= model.config.num_hidden_layers)  # one graph or more per layer
    # each layer's q/k/v shards lie end to end in one buffer, its gate/up shards do not; the local products read the
    # shards where they lie
    qkv = [[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")] for layer in model.model.layers]
    gate_up = [[getattr(layer.mlp, n) for n in ("gate_proj", "up_proj")] for layer in model.model.layers]

    def lie_packed(groups) -> list[bool]:
        shards = [[m.weight.to_local() for m in group] for group in groups]
        assert all(m.forward.weight.data_ptr() == w.data_ptr()
                   for group, ws in zip(groups, shards) for m, w in zip(group, ws))
        return [skinny.packed_rows(ws, [None] * len(ws)) is not None for ws in shards]

    packed = (all(lie_packed(qkv)), any(lie_packed(gate_up)))
    mlp = model.model.layers[1].mlp
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    traced = []
    for routed in (False, True):  # outside and inside the engine's skinny routing (shards it can read: bf16 ones)
        recorder = EagerAndRecordGraphs()
        locals_ = [m.forward for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        for local in locals_:
            local.skinny = routed
        with torch.no_grad(), forward_context(skinny_linears=True):
            traced_equal = torch.allclose(torch.compile(mlp, backend=recorder, fullgraph=True)(x), mlp(x), atol=1e-6)
        code = recorder.graphs[0].code
        traced.append((traced_equal, "hf_paged.tp_all_reduce" in code, "hf_paged.linear" in code, "DTensor" in code))
        torch._dynamo.reset()
    for local in locals_:
        local.skinny = False  # float32 shards: what refresh() found
    tensor_parallel = all(isinstance(layer.__dict__["forward"].owner.how.graph_pass, fusion.LayerPasses)
                          for layer in model.model.layers)
    return tokens, served, tp_linears.installed(model), traced, packed, tensor_parallel


def _fused_run(model, prompts) -> tuple:
    """The engine's compiled layers with peer_sum declared present (on CPU the fused ops then run their parts, the
    sum over gloo): its tokens, and for each compiled graph that holds an all-reduce the (fused add+norm, fused add,
    plain all-reduce) calls the passes left in it. The model's first compile decides how its layers compile
    (``compiled_layers``), and that was ``_compiled_run``'s engine, without peer_sum: the layers take what a first
    compile with peer_sum serving the group takes (``fusion.layer_compile``) for this run."""
    import torch._inductor.config as inductor_config

    from hf_paged.compile import _fuse_all_reduce as fusion_pass
    from hf_paged.compile._layers import compiled_layers
    from hf_paged.parallel import _fuse_all_reduce as fusion
    from hf_paged.parallel import _all_reduce as tp_all_reduce

    ops = (torch.ops.hf_paged.tp_all_reduce_add_rms_norm.default, torch.ops.hf_paged.tp_all_reduce_add.default,
           torch.ops.hf_paged.tp_all_reduce.default)
    seen, fuse, ready = [], fusion_pass.fuse_all_reduce, tp_all_reduce.fused_ready

    def counting(graph, is_ready):
        made = fuse(graph, is_ready)
        targets = [n.target for n in graph.nodes]
        counts = tuple(targets.count(op) for op in ops)
        if any(counts):
            seen.append(counts)
        return made

    fusion_pass.fuse_all_reduce, tp_all_reduce.fused_ready = counting, lambda name: True
    group_name = tensor_parallel(model).group.group_name
    layers = compiled_layers(model, fusion.layer_compile(group_name))
    first_compile, layers.how = layers.how, fusion.layer_compile(group_name)
    torch._dynamo.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False):  # a cached graph would skip the passes
            engine = hf_paged.Engine(model, num_blocks=24, block_size=8, max_batch_tokens=32, max_num_seqs=6,
                                     compile_layers=True)
            tokens = [o.token_ids for o in engine.generate(prompts, _greedy())]
    finally:
        nested = bool(DYNAMO_DEFAULTS)
        fusion_pass.fuse_all_reduce, tp_all_reduce.fused_ready = fuse, ready
        layers.how = first_compile
        torch._dynamo.reset()
    return tokens, sorted(set(seen)), len(seen) >= model.config.num_hidden_layers, nested


def _raise():
    raise RuntimeError("injected failure")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp_model")
    _, model = make_models("llama_gqa", seed=0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def single(saved):
    return AutoModelForCausalLM.from_pretrained(saved, attn_implementation="hf_paged", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ranks(saved, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp_ranks")
    context = mp.start_processes(_worker, args=(_free_port(), saved, str(out_dir)), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline, exited = time.monotonic() + DEADLINE_S, None
    while True:
        try:
            if context.join(timeout=2):
                break
        except mp.ProcessExitedException as exc:  # rank 1 left on purpose; join then ended rank 0
            exited = (exc.error_index, exc.exit_code)
            break
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD_SIZE} ranks did not finish within {DEADLINE_S} s (a rank left waiting?)")
    records = [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]
    stuck = out_dir / "rank1_stuck.pkl"
    records[1]["stuck"] = (exited, pickle.loads(stuck.read_bytes()) if stuck.exists() else None)
    return records


@pytest.mark.slow
def test_each_rank_pools_its_own_kv_heads_and_the_ranks_agree_on_the_pool_size(ranks):
    assert [r["kv_heads"] for r in ranks] == [(1, 1)] * WORLD_SIZE  # the config says 2
    assert ranks[0]["sized_blocks"] == ranks[1]["sized_blocks"]  # each rank's free memory differs
    assert ranks[0]["graphs"] is None


@pytest.mark.slow
@pytest.mark.parametrize("scenario, config", [("engine", _greedy), ("seeded", lambda: _sampled(5))])
def test_the_engine_gives_every_rank_the_tokens_of_one_process(ranks, single, scenario, config):
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), config())]
    for rank in ranks:
        assert rank[scenario] == ("ok", expected)


@pytest.mark.slow
def test_unseeded_sampling_gives_every_rank_the_leaders_tokens(ranks):
    status, tokens = ranks[0]["unseeded"]
    assert status == "ok" and ranks[1]["unseeded"] == ("ok", tokens)


@pytest.mark.slow
def test_generate_batch_gives_every_rank_the_tokens_of_one_process(ranks, single):
    expected = _tokens(hf_paged.generate_batch(single, _prompts(0), _greedy()))
    for rank in ranks:
        assert rank["generate_batch"] == ("ok", expected)
        assert rank["persistent"] == ("ok", [expected[:4], expected[:3]])


@pytest.mark.slow
def test_generate_with_paged_cache_for_gives_the_tokens_of_one_process(ranks, single):
    batch = left_padded_batch([5, 17, 30], torch.Generator().manual_seed(2))
    expected = single.generate(**batch, **GREEDY).tolist()  # transformers' own cache
    for rank in ranks:
        assert rank["generate"] == ("ok", expected)


@pytest.mark.slow
def test_a_bad_prompt_raises_the_same_error_on_every_rank(ranks):
    kind, message = ranks[0]["bad_prompt"][1:]
    assert kind == "ValueError" and f"got {VOCAB + 5}" in message
    assert ranks[1]["bad_prompt"] == ranks[0]["bad_prompt"]
    (status, kind, message), installed = ranks[0]["compile_refused"]
    assert (status, kind) == ("error", "ValueError") and "layers.0.mlp.down_proj is sharded in a way" in message
    assert "compile_layers=False" in message and installed == 0  # nothing was changed
    assert ranks[1]["compile_refused"] == ranks[0]["compile_refused"]


@pytest.mark.slow
def test_compiled_layers_run_sharded_linears_as_local_products_and_give_the_tokens_of_one_process(ranks, single):
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _greedy())]
    linears = 7 * single.config.num_hidden_layers  # q, k, v, o, gate, up, down per layer
    for rank in ranks:
        # traced: (equal to eager, holds the all-reduce op, holds the skinny op, holds a DTensor) without and with
        # the skinny routing of the local shards
        # packed: (every layer's q/k/v, any layer's gate/up); then the compiled forwards' tensor-parallel state
        assert rank["compiled"] == ("ok", (expected, True, linears, [(True, True, False, False),
                                                                    (True, True, True, False)], (True, False), True))


@pytest.mark.slow
def test_compiled_layers_fold_each_add_and_norm_into_the_all_reduce_before_it(ranks, single):
    """The engine's own compiled layers fuse (hf_paged/parallel/_fuse_all_reduce.py) where peer_sum serves, and give
    the tokens of one process. With dynamo's nested graph breaks (where this torch has them), a layer's work after
    attention is one graph: attention's all-reduce takes the residual add and the norm after it, the MLP's the
    residual add, and no plain all-reduce is left. Without them the attention module's rest (o_proj and its
    all-reduce, returned) is a graph of its own and only the MLP's all-reduce takes its add."""
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _greedy())]
    nested = "nested_graph_breaks" in torch._dynamo.config._config
    # (fused add+norm, fused add, plain all-reduce) per compiled graph holding any
    graphs = [(1, 1, 0)] if nested else [(0, 0, 1), (0, 1, 0)]
    for rank in ranks:
        assert rank["compiled_fused"] == ("ok", (expected, graphs, True, nested))


@pytest.mark.slow
def test_logits_left_sharded_give_the_tokens_and_logprobs_of_one_process(ranks, single):
    """The engine's logits left sharded over the vocabulary (hf_paged/parallel/_logits.py): its model calls return
    each rank's half of the vocabulary; plain-greedy steps exchange (value, id) pairs, every other step gathers the
    halves first. Greedy, seeded sampling, logprobs and min_new_tokens (a processed greedy row) give one process's
    tokens, logprobs within float tolerance; both paths served, on half-width logits; the lm_head's own path is back
    afterwards."""
    engine = _engine(single)
    prompts = _prompts(0)
    greedy = [o.token_ids for o in engine.generate(prompts, _greedy())]
    seeded = [o.token_ids for o in engine.generate(prompts, _sampled(5))]
    logprobs = [(o.token_ids, o.logprobs) for o in engine.generate(prompts[:3], _greedy_logprobs())]
    held = [o.token_ids for o in engine.generate(prompts[:3], _greedy(min_new_tokens=8))]
    assert all(len(t) == 8 for t in held) and all(lp is not None and len(lp) == len(t) for t, lp in logprobs)
    for rank in ranks:
        status, result = rank["sharded_logits"]
        assert status == "ok", result
        got_greedy, got_seeded, got_logprobs, got_held, exchanged, gathered, widths, local = result
        assert (got_greedy, got_seeded, got_held) == (greedy, seeded, held)
        assert [t for t, _ in got_logprobs] == [t for t, _ in logprobs]
        for (_, got), (_, want) in zip(got_logprobs, logprobs):
            assert got == pytest.approx(want, abs=1e-4)
        assert exchanged and gathered and widths == {VOCAB // WORLD_SIZE} and local


def test_the_argmax_of_shard_maxima_is_the_argmax_of_the_row():
    """tp_logits.pick against torch's argmax over whole rows split in halves: ties go to the lower id (the first
    shard), a NaN wins as the first NaN, -inf rows and +inf values are kept apart."""
    from hf_paged.parallel._logits import pick

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-3, 3, (64, 10), generator=gen).float()  # few values: many ties within and across halves
    rows[5, 7] = float("nan")
    rows[6, :] = float("-inf")
    rows[7, 8] = float("inf")
    rows[8, 2], rows[8, 9] = float("nan"), float("nan")
    rows[9, 1], rows[9, 6] = float("inf"), float("inf")
    halves = rows.view(64, 2, 5)
    values, ids = halves.max(-1)  # each shard's first maximum, as VocabShards.argmax takes it
    everyone = torch.stack([values.t(), ids.t().float()], -1)  # [2, 64, 2]: ids within each half
    want = torch.from_numpy(rows.numpy().argmax(-1))  # numpy: first maximum, first NaN (the CPU sampler's argmax)
    assert torch.equal(pick(everyone, 5), want)
    assert torch.equal(rows.argmax(-1), want)  # (and torch's, which the GPU sampler takes)


@pytest.mark.slow
def test_ranks_given_different_prompts_stop_with_the_same_error(ranks):
    kind, message = ranks[0]["different_prompts"][1:]
    assert kind == "RuntimeError" and "scheduled different steps" in message
    assert ranks[1]["different_prompts"] == ranks[0]["different_prompts"]


@pytest.mark.slow
def test_a_failed_step_on_one_rank_is_raised_on_every_rank(ranks):
    kind, message = ranks[0]["failed_step"][1:]
    assert kind == "RuntimeError"
    assert "a tensor-parallel step failed on rank 1 of 2: RuntimeError: injected failure" in message
    assert ranks[1]["failed_step"] == ranks[0]["failed_step"]
    for rank in ranks:  # the engine refuses to go on; a new one runs
        assert rank["after_failed_step"][:2] == ("error", "RuntimeError")
        assert "stopped after an earlier error" in rank["after_failed_step"][2]
        assert rank["after_failures"][0] == "ok" and len(rank["after_failures"][1]) == 3


@pytest.mark.slow
def test_a_failure_inside_one_ranks_forward_ends_with_a_timeout_message(ranks):
    exited, stuck = ranks[1]["stuck"]
    assert exited == (1, STUCK_EXIT)  # rank 1 got its error and left; rank 0, stuck in an all-reduce, was ended
    kind, message = stuck[1:]
    assert kind == "RuntimeError" and "injected failure" in message
    assert "did not reach step 1's check within 3 s" in message


def test_a_model_without_sharded_weights_is_not_tensor_parallel():
    _, model = make_models("llama_gqa")
    assert tensor_parallel(model) is None
    assert kv_layout(model) == hf_paged.cache.KVLayout.from_config(model.config)


@pytest.mark.slow
def test_the_benchmark_runs_two_cpu_processes_in_its_tiny_mode(tmp_path, capsys):
    from benchmarks.parallel import tensor_parallel

    out = tmp_path / "tp.json"
    tensor_parallel.main(["--tiny", "--gpus", "2", "--systems", "hf_paged", "--tp-eager", "--tp-peer-sum", "--split",
                          "--json", str(out)])
    row, eager, peer_sum, split = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["gpus"] == 2 and row["system"] == "hf_paged"
    assert eager["status"] == "ok" and eager["system"] == "hf_paged (eager)"
    # (on CPU processes the peer_sum mode has no CUDA buffers to set up: gloo serves, the run completes)
    assert peer_sum["status"] == "ok" and peer_sum["system"] == "hf_paged (peer_sum)"
    assert row["decode"]["full_call_s"] > 0 and row["latency"]["full_call_s"] > 0
    assert len(row["decode"]["short_calls_s"]) == len(row["decode"]["full_calls_s"]) == 1  # every rep kept
    # the steady decode: every request of the batch decoding in each timed step, on both ranks in step
    assert row["steady"]["batch"] == 4 and row["steady"]["steps"] == 4 and row["steady"]["ms_per_step"] > 0
    assert split["status"] == "ok" and split["gpus"] == 2 and split["system"] == "hf_paged (split)"
    assert split["decode"]["full_call_s"] > 0
    printed = capsys.readouterr().out
    assert "hf_paged                  2" in printed and "hf_paged (split)          2" in printed


@pytest.mark.slow
def test_the_benchmarks_steady_only_mode_skips_the_batch_64_calls(tmp_path, capsys):
    from benchmarks.parallel import tensor_parallel

    out = tmp_path / "tp.json"
    tensor_parallel.main(["--tiny", "--gpus", "2", "--systems", "hf_paged", "--steady-only", "--json", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and "decode" not in row and "decode_tok_per_s" not in row
    assert row["steady"]["batch"] == 4 and row["steady"]["tok_per_s"] > 0 and row["latency"]["full_call_s"] > 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("hf_paged   "))
    assert line.split()[2] == "-"  # no batch-64 call rate; the steady columns follow
    assert f"{row['steady']['ms_per_step']:.2f}" in line and f"{row['ms_per_token']:.2f}" in line
    assert set(row["phase_s"]) == {"load", "latency", "steady"} and all(v >= 0 for v in row["phase_s"].values())
    # --no-latency: the steady step alone; --variants-only: no plain run, only the variant asked for
    tensor_parallel.main(["--tiny", "--gpus", "2", "--systems", "hf_paged", "--steady-only", "--no-latency",
                          "--variants-only", "--tp-nccl", "--json", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["system"] == "hf_paged (NCCL)"
    assert "latency" not in row and "ms_per_token" not in row and row["steady"]["tok_per_s"] > 0
    assert set(row["phase_s"]) == {"load", "steady"}
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("hf_paged (NCCL)"))
    assert line.split()[-1] == "-"  # the batch-1 column left empty


def test_the_benchmark_plans_each_variant_on_the_counts_it_compares():
    from benchmarks.parallel import tensor_parallel

    args = tensor_parallel.parse_args(["--gpus", "1,2", "--tp-peer-sum", "--tp-nccl", "--cublaslt"])
    runs = tensor_parallel.planned_runs(args, [1, 2])
    assert runs == [(1, "", {}), (2, "", {}), (2, " (peer_sum)", {"HF_PAGED_TP_ALL_REDUCE": "hf_paged"}),
                    (2, " (NCCL)", {"HF_PAGED_TP_ALL_REDUCE": "nccl"}),
                    (1, " (cublaslt)", {"TORCH_BLAS_PREFER_CUBLASLT": "1"}),
                    (2, " (cublaslt)", {"TORCH_BLAS_PREFER_CUBLASLT": "1"})]
    assert tensor_parallel.planned_runs(tensor_parallel.parse_args(["--gpus", "2"]), [2]) == [(2, "", {})]
    only = tensor_parallel.parse_args(["--gpus", "1,2", "--variants-only", "--tp-nccl"])
    assert tensor_parallel.planned_runs(only, [1, 2]) == [(2, " (NCCL)", {"HF_PAGED_TP_ALL_REDUCE": "nccl"})]
    every = tensor_parallel.parse_args(["--gpus", "1,2", "--tp-eager", "--tp-layers-eager", "--split"])
    assert [(c, v) for c, v, _ in tensor_parallel.planned_runs(every, [1, 2])] == [
        (1, ""), (2, ""), (2, " (eager)"), (2, " (layers eager)"), (1, " (split)")]
    for removed in ("--tp-no-pack", "--tp-pack-all", "--tp-no-views", "--tp-no-fuse", "--tp-prefetch",
                    "--tp-gathered-logits", "--tp-one-shot", "--tp-no-pdl", "--compile-pdl", "--skinny-wide",
                    "--skinny-wgmma"):
        with pytest.raises(SystemExit):
            tensor_parallel.parse_args(["--gpus", "2", removed])


@pytest.mark.slow
def test_the_benchmark_keeps_its_model_for_a_later_run(tmp_path, capsys):
    from benchmarks.parallel import tensor_parallel

    kept = tmp_path / "model"
    for _ in range(2):
        tensor_parallel.main(["--tiny", "--gpus", "1", "--systems", "hf_paged", "--keep-model", str(kept)])
    printed = capsys.readouterr().out
    assert printed.count("saving a random-init tiny model") == 1
    assert printed.count(f"reusing the model saved in {kept}") == 1
    (kept / "shape.json").write_text('{"hidden_size": 4096}')  # another shape: refused, not silently reused
    with pytest.raises(SystemExit, match="another shape"):
        tensor_parallel.main(["--tiny", "--gpus", "1", "--systems", "hf_paged", "--keep-model", str(kept)])


def test_the_benchmark_split_map_gives_each_device_a_run_of_layers():
    from benchmarks.parallel.tensor_parallel import split_map

    device_map = split_map(5, [0, 1])
    assert [device_map[f"model.layers.{i}"] for i in range(5)] == [0, 0, 0, 1, 1]
    assert device_map["model.embed_tokens"] == 0 and device_map["lm_head"] == 1 and device_map["model.norm"] == 1


def test_the_all_reduce_switch_is_checked_and_peer_sum_serves_only_cuda(monkeypatch):
    from hf_paged import envs
    from hf_paged.parallel import _all_reduce as tp_all_reduce

    monkeypatch.setenv("HF_PAGED_TP_ALL_REDUCE", "ring")
    envs.refresh()
    with pytest.raises(ValueError, match="HF_PAGED_TP_ALL_REDUCE='ring': use one of hf_paged, nccl"):
        envs.tp_all_reduce()
    for mode in ("nccl", "hf_paged"):
        monkeypatch.setenv("HF_PAGED_TP_ALL_REDUCE", mode)
        envs.refresh()
        assert envs.tp_all_reduce() == mode
        # on the CPU peer_sum is not set up (no collective is attempted: no group is needed)
        assert tp_all_reduce.prepare(None, torch.device("cpu")) is False
    monkeypatch.delenv("HF_PAGED_TP_ALL_REDUCE")
    envs.refresh()
    assert envs.tp_all_reduce() == "hf_paged"  # peer_sum is the default


class _NineRanks:
    group_name = "nine"

    def size(self):
        return 9


@pytest.mark.parametrize("asked", [False, True])
def test_peer_sum_refuses_more_ranks_than_it_serves_and_says_so_by_how_it_was_asked(monkeypatch, caplog, asked):
    """A group beyond peer_sum's 8 ranks keeps NCCL: quietly (an info line) where peer_sum is only the default, with a
    warning where HF_PAGED_TP_ALL_REDUCE named it. Nothing is set up (no collective runs: the size check comes
    first)."""
    from hf_paged.parallel import _all_reduce as tp_all_reduce

    if asked:
        monkeypatch.setenv("HF_PAGED_TP_ALL_REDUCE", "hf_paged")
    else:
        monkeypatch.delenv("HF_PAGED_TP_ALL_REDUCE", raising=False)
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert tp_all_reduce.prepare(_NineRanks(), torch.device("cuda", 0)) is False
    [record] = [r for r in caplog.records if "cannot be served" in r.getMessage()]
    assert record.levelno == (logging.WARNING if asked else logging.INFO)
    assert "up to 8 ranks, this one has 9" in record.getMessage() and "through NCCL" in record.getMessage()
    assert ("HF_PAGED_TP_ALL_REDUCE=hf_paged" in record.getMessage()) == asked
    assert "nine" not in tp_all_reduce._peers
