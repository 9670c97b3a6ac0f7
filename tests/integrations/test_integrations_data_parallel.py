"""Data parallel: ``distributed_generate_batch`` over two CPU processes (gloo) returns on every rank what one
``generate_batch`` call returns for all the prompts, runs a token-balanced share on each rank, and turns one rank's
failure into the same error on every rank."""

from __future__ import annotations

import os
import pathlib
import pickle
import random
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import EOS, PAD, VOCAB, make_models
from transformers import GenerationConfig

import hf_paged
from hf_paged.engine import _data_parallel as adapter
from hf_paged.integrations.accelerate import balanced_shares, distributed_generate_batch

WORLD_SIZE = 2
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
DEADLINE_S = 240  # a rank left waiting in a collective shows up as this timeout, not as a stuck test run


def _prompts(seed: int, n: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def _greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=7, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


def _sampled() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=2, seed=11,
                            pad_token_id=PAD, eos_token_id=EOS)


def _tokens(results) -> list[tuple[str, str, list[int]]]:
    return [(rid, out.request_id, list(out.generated_tokens)) for rid, out in results.items()]


def _outcome(call):
    try:
        return "ok", _tokens(call())
    except Exception as exc:  # the scenario's expected failures are compared by the parent
        return "error", type(exc).__name__, str(exc)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    _, model = make_models("llama_gqa", seed=0)
    shares = []
    run_share = adapter.generate_batch
    adapter.generate_batch = lambda m, inputs, *a, **k: shares.append([len(p) for p in inputs]) or run_share(
        m, inputs, *a, **k)
    prompts = _prompts(0)
    bad = [p if i != 4 else [VOCAB + 5] for i, p in enumerate(prompts)] if rank == 1 else prompts
    shorter = [p[:-1] if i == 0 else p for i, p in enumerate(prompts)] if rank == 1 else prompts
    seeded = type("Settings", (), {"seed": 3})()
    record = {
        "greedy": _outcome(lambda: distributed_generate_batch(model, prompts, _greedy())),
        "sampled": _outcome(lambda: distributed_generate_batch(model, prompts, _sampled())),
        "bad_prompt_on_rank_1": _outcome(lambda: distributed_generate_batch(model, bad, _greedy())),
        "different_prompts": _outcome(lambda: distributed_generate_batch(model, shorter, _greedy())),
        "seeded_config": _outcome(lambda: distributed_generate_batch(
            model, prompts, _sampled(), continuous_batching_config=seeded)),
        "after_failures": _outcome(lambda: distributed_generate_batch(model, prompts[:3], _greedy())),
    }
    record["shares"] = shares
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("data_parallel")
    context = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD_SIZE} ranks did not finish within {DEADLINE_S} s (a rank left waiting?)")
    return [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, config", [("greedy", _greedy), ("sampled", _sampled)])
def test_every_rank_returns_what_one_process_returns(ranks, scenario, config):
    _, model = make_models("llama_gqa", seed=0)
    expected = _tokens(hf_paged.generate_batch(model, _prompts(0), config()))
    assert expected[0][0] == ("req_0__child#0" if scenario == "sampled" else "req_0")  # copies first
    for rank in ranks:
        assert rank[scenario] == ("ok", expected)


@pytest.mark.slow
def test_the_seed_of_the_continuous_batching_config_seeds_by_position_in_all_the_inputs(ranks):
    """Each rank's share keeps its prompts' positions (generate_batch's indices), so the per-request seeds, and the
    samples, are one process's."""
    _, model = make_models("llama_gqa", seed=0)
    seeded = type("Settings", (), {"seed": 3})()
    expected = _tokens(hf_paged.generate_batch(model, _prompts(0), _sampled(), continuous_batching_config=seeded))
    for rank in ranks:
        assert rank["seeded_config"] == ("ok", expected)


@pytest.mark.slow
def test_each_rank_runs_its_token_balanced_share(ranks):
    prompts, max_new = _prompts(0), _greedy().max_new_tokens
    costs = [len(p) + max_new for p in prompts]
    for rank, share in enumerate(balanced_shares(costs, WORLD_SIZE)):
        assert ranks[rank]["shares"][0] == [len(prompts[i]) for i in share]  # the greedy call's share
    loads = [sum(n + max_new for n in r["shares"][0]) for r in ranks]
    assert sum(loads) == sum(costs) and max(loads) - min(loads) <= max(costs)


@pytest.mark.slow
def test_a_failure_on_one_rank_is_raised_on_every_rank(ranks):
    kind, message = ranks[0]["bad_prompt_on_rank_1"][1:]
    assert kind == "ValueError" and message.startswith("distributed_generate_batch failed on rank 1 of 2: ")
    assert f"got {VOCAB + 5}" in message
    assert [r["bad_prompt_on_rank_1"] for r in ranks] == [ranks[0]["bad_prompt_on_rank_1"]] * WORLD_SIZE
    assert [r["different_prompts"][:2] for r in ranks] == [("error", "ValueError")] * WORLD_SIZE
    assert "different prompts" in ranks[0]["different_prompts"][2]
    # the ranks stay in step: a call after the failures still runs
    assert all(r["after_failures"][0] == "ok" and len(r["after_failures"][1]) == 3 for r in ranks)


def test_one_process_is_plain_generate_batch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, model = make_models("llama_gqa", seed=0)
    prompts = _prompts(1, n=4)
    assert _tokens(distributed_generate_batch(model, prompts, _greedy())) == _tokens(
        hf_paged.generate_batch(model, prompts, _greedy()))


def test_balanced_shares_is_longest_first():
    assert balanced_shares([10, 9, 8, 7, 6, 5, 4], 2) == [[0, 3, 4], [1, 2, 5, 6]]
    assert balanced_shares([5, 5], 3) == [[0], [1], []]
    assert balanced_shares([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        balanced_shares([1], 0)


def test_balanced_shares_cover_every_request_within_the_bound():
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))]
        world_size = rng.randrange(1, 9)
        shares = balanced_shares(costs, world_size)
        assert sorted(i for share in shares for i in share) == list(range(len(costs)))
        assert shares == balanced_shares(list(costs), world_size)
        best_possible = max(max(costs), sum(costs) / world_size)
        assert max(sum(costs[i] for i in share) for share in shares) <= 4 / 3 * best_possible


@pytest.mark.slow
def test_the_example_under_torchrun_prints_what_one_process_prints(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE.parents[1])}
    run = lambda *launcher: subprocess.run([sys.executable, *launcher, str(EXAMPLE), "--model", "tiny",
                                            "--max-new-tokens", "6"],
                                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    alone = run()
    assert alone.returncode == 0, alone.stderr
    launched = run("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}")
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout and "24 requests" in alone.stdout
