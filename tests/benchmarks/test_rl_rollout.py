"""The RL rollout benchmark (``benchmarks/e2e/rl_rollout.py``) in its CPU smoke mode: every system runs every round
(a fused AdamW step, then TRL's ``generate_batch`` call), returns all the tokens asked for,
and the result carries the run's header, the counters and the summary the table prints. Its times mean nothing here."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from benchmarks.e2e import rl_rollout

pytestmark = pytest.mark.slow


def test_rl_rollout_smoke_runs_every_round_of_every_system(tmp_path):
    path = tmp_path / "rl.json"
    threads, printed = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            result = rl_rollout.main(["--smoke", "--rounds", "2", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert {"card", "torch", "transformers", "hf_paged_commit", "date"} <= set(result["meta"])
    rows = result["rows"]
    assert [(r["system"], r["round"]) for r in rows] == [(s, i) for s in rl_rollout.SYSTEMS for i in range(2)]
    assert all(r["tokens"] == r["expected_tokens"] == 2 * 2 * 4 for r in rows)
    assert all(r["recompiles"] == 0 and r["captures"] == 0 for r in rows)  # (the CPU: no graphs, layers eager)
    summary = {s["system"]: s for s in result["summary"]}
    assert summary["hf_paged"]["all_tokens"] and summary["transformers"]["all_tokens"]
    assert summary["hf_paged"]["speedup"] > 0
    assert printed.getvalue().splitlines()[-3].split() == ["system", "first", "s", "later", "s", "tok/s",
                                                           "recompiles", "captures", "speedup"]


def test_capture_counter_counts_each_capture_and_calls_through():
    calls = []
    counted = rl_rollout._counting(lambda self, *args, **kwargs: calls.append((self, args, kwargs)))
    before = rl_rollout._CAPTURES[0]
    counted("graph", "pool", capture_error_mode="thread_local")
    assert rl_rollout._CAPTURES[0] == before + 1 and calls == [("graph", ("pool",), {"capture_error_mode":
                                                                                       "thread_local"})]
