"""``hf_paged.bench.time_calls`` off CUDA: the calls run as a loop timed by the host clock, every callable once per
rep after one warm-up run each, ``reps`` fixed or fitted to the budget, ``before_rep`` before each rep."""

from __future__ import annotations

import pytest

from hf_paged.bench import time_calls


def test_each_rep_runs_every_call_once_after_one_warm_up_run():
    counts, events = [0, 0], []
    calls = [lambda: counts.__setitem__(0, counts[0] + 1), lambda: counts.__setitem__(1, counts[1] + 1)]
    timing = time_calls(calls, reps=7, before_rep=lambda: events.append(tuple(counts)), device="cpu")
    assert timing.method == "host" and timing.reps == 7
    assert counts == [8, 8]  # one warm-up run each, then one per rep
    assert events == [(i, i) for i in range(1, 8)]  # before each rep, after the previous one
    assert 0 <= timing.min_s <= timing.median_s <= timing.max_s


def test_without_reps_the_count_fits_the_budget_within_its_bounds():
    calls = []
    timing = time_calls([lambda: calls.append(1)], budget_s=1e-9, device="cpu")
    assert timing.reps == 5  # the fewest
    assert len(calls) == 1 + 1 + 5  # warm-up, the sizing rep, the timed reps


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_any_device_but_cuda_is_timed_on_the_host(device):
    assert time_calls([lambda: None], reps=3, device=device).method == "host"
