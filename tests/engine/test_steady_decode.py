"""The steady decode path (``engine/steady_decode.py``) against the general step it stands in for.

An engine whose steady runs are switched off (``SteadyDecode.after`` returns None) is the oracle: with them on, every
request's tokens, finish reason and streamed deltas must be the same, the prefix cache must hold the same blocks, and
the block manager's invariants must hold after every step. The workloads make the run start and stop often: arrivals
while others decode, EOS hits, different length limits, preemption on a tight cache, an abort mid-run, and requests
the steady path leaves to the general one (logprobs, stop strings are not used on the CPU: no tokenizer). Each test
also checks that the steady path served a good share of the steps, so it cannot pass by never running.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged.engine import _steady_decode as steady_decode
from hf_paged.engine._sequence import PLACEHOLDER


def _configs(n: int, mixed: bool) -> list[GenerationConfig]:
    out = []
    for i in range(n):
        if not mixed or i % 4 == 0:
            out.append(GenerationConfig(max_new_tokens=24 + i % 5, do_sample=False, eos_token_id=None))
        elif i % 4 == 1:  # ends early on a common token, at different steps
            out.append(GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=list(range(3, 40))))
        elif i % 4 == 2:  # min_new_tokens: the sampler processes the row; EOS only after 8 tokens
            out.append(GenerationConfig(max_new_tokens=26, min_new_tokens=8, do_sample=False,
                                        eos_token_id=list(range(3, 50))))
        elif i == 3:  # logprobs: while it runs, every step takes the general hand-over
            out.append(GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None,
                                        output_logprobs=True))
        else:
            out.append(GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None))
    return out


def _run(monkeypatch, steady: bool, async_scheduling: bool, num_blocks: int = 400, mixed: bool = True,
         abort_at: int | None = None, arrive_every: int = 3):
    counts = {"steady": 0, "steps": 0}
    if not steady:
        monkeypatch.setattr(steady_decode.SteadyDecode, "after", classmethod(lambda cls, *a, **k: None))
    else:
        real = steady_decode.SteadyDecode.commit

        def counted(self, *args, **kwargs):
            counts["steady"] += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(steady_decode.SteadyDecode, "commit", counted)
    _, paged = models("llama_gqa")
    engine = hf_paged.Engine(paged, num_blocks=num_blocks, block_size=4, max_batch_tokens=64, max_num_seqs=8,
                             async_scheduling=async_scheduling, enable_prefix_caching=True)
    prefix = random_prompts(1, 9, 9, seed=5)[0]
    prompts = random_prompts(14, 2, 20, seed=7, prefixes=[prefix, []])
    pending = list(zip(prompts, _configs(len(prompts), mixed)))
    outs, streamed, ids = {}, {}, []
    while pending or engine.has_unfinished():
        if pending and counts["steps"] % arrive_every == 0:
            ids.append(engine.add_request(*pending.pop(0)))
        finished, deltas = engine.step_with_deltas()
        for delta in deltas:
            assert PLACEHOLDER not in delta.token_ids
            streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
        for out in finished:
            outs[out.request_id] = (out.finish_reason, list(out.token_ids), out.logprobs)
        counts["steps"] += 1
        engine.scheduler.check_invariants()
        if abort_at is not None and counts["steps"] == abort_at:
            engine.abort(ids[2])
    monkeypatch.undo()
    cached = set(engine.block_manager._key_to_block)
    return outs, streamed, cached, counts, engine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steady_decode_gives_the_general_steps_tokens_deltas_and_prefix_cache(monkeypatch, async_scheduling):
    want, want_streamed, want_cached, _, _ = _run(monkeypatch, False, async_scheduling)
    got, got_streamed, got_cached, counts, engine = _run(monkeypatch, True, async_scheduling)
    assert got == want
    assert got_streamed == want_streamed
    assert got_cached == want_cached  # every full block registered, as the general commit does
    assert {reason for reason, _, _ in got.values()} >= {"stop", "length"}
    assert counts["steady"] >= counts["steps"] // 3, counts  # the steady path carried many of the steps
    allocator = engine.block_manager.allocator
    assert allocator.num_free == allocator.num_blocks  # no block leaked


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steady_decode_under_preemption_and_an_abort(monkeypatch, async_scheduling):
    """A cache too small for all the sequences: steady runs end when a sequence needs a block the free list cannot
    give (the general scheduler preempts), and an abort between steps ends the run too."""
    kwargs = {"num_blocks": 24, "abort_at": 9, "arrive_every": 1}
    want, want_streamed, _, _, _ = _run(monkeypatch, False, async_scheduling, **kwargs)
    got, got_streamed, _, counts, engine = _run(monkeypatch, True, async_scheduling, **kwargs)
    assert got == want and got_streamed == want_streamed
    assert "abort" in {reason for reason, _, _ in got.values()}
    assert engine.scheduler.num_preemptions > 0
    assert counts["steady"] > 0


def test_steady_decode_serves_plain_greedy_decode_alone(monkeypatch):
    """Nothing but plain greedy requests, all admitted at once: after the prefill, every decode step but the first
    of each run and the last ones (where lengths end) is steady."""
    got, _, _, counts, _ = _run(monkeypatch, True, True, mixed=False, arrive_every=1)
    want, _, _, _, _ = _run(monkeypatch, False, True, mixed=False, arrive_every=1)
    assert got == want
    assert counts["steady"] >= counts["steps"] // 2, counts


def test_a_block_that_cannot_be_given_changes_nothing(monkeypatch):
    """``add_last_blocks`` is all or nothing: with fewer free blocks than sequences at a block boundary, the steady
    schedule gives up without taking any block, and the general scheduler preempts."""
    _, paged = models("llama_gqa")
    engine = hf_paged.Engine(paged, num_blocks=64, block_size=4, max_batch_tokens=64, max_num_seqs=8,
                             async_scheduling=False)
    for prompt in random_prompts(4, 3, 3, seed=1):  # at a block boundary after the prefill and one decode step
        engine.add_request(prompt, GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None))
    engine.step()
    engine.step()
    steady = engine._steady
    assert steady is not None and (steady.computed % 4 == 0).all()
    allocator = engine.block_manager.allocator
    hold = allocator.allocate(allocator.num_free - 2)  # two free blocks for four sequences
    tables = [list(s.block_table) for s in steady.seqs]
    assert steady.schedule(engine.scheduler) is None
    assert [s.block_table for s in steady.seqs] == tables and allocator.num_free == 2
    allocator.free(hold)
    assert steady.schedule(engine.scheduler) is steady.batch
    assert all(len(s.block_table) == len(t) + 1 for s, t in zip(steady.seqs, tables))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_during_a_steady_steps_device_work_ends_the_run(monkeypatch, async_scheduling):
    """Another thread may abort while the device works (the engine's lock is released then): the step's hand-over
    must see it and take the general path, which leaves the aborted sequence out, as the general step does."""

    def run(steady: bool):
        if not steady:
            monkeypatch.setattr(steady_decode.SteadyDecode, "after", classmethod(lambda cls, *a, **k: None))
        _, paged = models("llama_gqa")
        engine = hf_paged.Engine(paged, num_blocks=200, block_size=4, max_batch_tokens=64, max_num_seqs=8,
                                 async_scheduling=async_scheduling)
        config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
        ids = [engine.add_request(p, config) for p in random_prompts(4, 5, 9, seed=2)]
        forward, calls = engine.runner.forward, []

        def forward_then_abort(plan):
            out = forward(plan)
            calls.append(engine._steady is not None)
            if len(calls) == 6:
                assert calls[-1] == steady
                engine.abort(ids[1])  # as another thread would, while the lock is released
            return out

        monkeypatch.setattr(engine.runner, "forward", forward_then_abort)
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = (out.finish_reason, list(out.token_ids))
            engine.scheduler.check_invariants()
        monkeypatch.undo()
        assert outs[ids[1]][0] == "abort" and len(outs[ids[1]][1]) < 12
        return outs

    assert run(True) == run(False)


def test_write_entries_sets_grows_and_logs_like_one_write_per_entry():
    from hf_paged.cache._block_table import BlockTableBuffer

    one, many = BlockTableBuffer(4, 2), BlockTableBuffer(4, 2)
    for buf in (one, many):
        buf.log_changes()
    rows, columns, blocks = [2, 0, 3], [1, 4, 0], [7, 9, 5]  # column 4 is past the width: both grow
    for r, c, b in zip(rows, columns, blocks):
        one.write(r, c, [b])
    many.write_entries(rows, columns, blocks)
    assert many.table.shape == one.table.shape and many.table.shape[1] >= 5
    assert many.table.equal(one.table)
    assert [list(x) for x in many.take_changes()] == [list(x) for x in one.take_changes()]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_logprobs_rows_stay_on_the_steady_path_and_keep_every_logprob(monkeypatch, async_scheduling):
    """Rows that ask for logprobs keep one per token on the steady path, the same as the general hand-over's."""

    def run(steady: bool):
        commits = []
        if not steady:
            monkeypatch.setattr(steady_decode.SteadyDecode, "after", classmethod(lambda cls, *a, **k: None))
        else:
            real = steady_decode.SteadyDecode.commit
            monkeypatch.setattr(steady_decode.SteadyDecode, "commit",
                                lambda self, *a, **k: (commits.append(bool(self.logprob_rows)), real(self, *a, **k)))
        _, paged = models("llama_gqa")
        engine = hf_paged.Engine(paged, num_blocks=200, block_size=4, max_batch_tokens=64, max_num_seqs=8,
                                 async_scheduling=async_scheduling)
        configs = [GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=list(range(3, 30)),
                                    output_logprobs=i % 2 == 0) for i in range(5)]
        outs = {o.request_id: (o.finish_reason, o.token_ids, o.logprobs)
                for o in engine.generate(random_prompts(5, 3, 12, seed=4), configs)}
        monkeypatch.undo()
        return outs, commits

    (got, commits), (want, _) = run(True), run(False)
    assert got == want
    assert sum(commits) >= 5, commits  # steady steps with logprobs rows in them
    for reason, tokens, logprobs in got.values():
        assert logprobs is None or (len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs))
