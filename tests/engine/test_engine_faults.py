"""Step atomicity: an exception or a Ctrl-C anywhere in a step leaves the engine consistent and usable, loses no
output, and ends only the request whose fault it is.

Faults are injected into the model forward and the sampler (raise once, at a chosen call) and into the host's
bookkeeping (a real SIGINT in the middle of the stop checks). After every step the block pool is checked against
the live requests; at the end every request must have been reported exactly once, with the tokens of a clean run.
"""

from __future__ import annotations

import os
import signal

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts

ARCH = "llama_gqa"
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def workload(n: int = 10, seed: int = 3) -> list[tuple[list[int], GenerationConfig]]:
    """Greedy, early stops, min_new_tokens, repetition penalty and seeded sampling with copies. The early-stop kinds
    ask for logprobs, so their every token goes through ``EngineCore._stop_reason`` (plain rows skip it unless
    they reach EOS or their length), which the fault tests below wrap."""
    kinds = [
        dict(max_new_tokens=9, do_sample=False, eos_token_id=None),
        dict(max_new_tokens=10, do_sample=False, eos_token_id=list(range(3, 50)), output_logprobs=True),
        dict(max_new_tokens=8, min_new_tokens=5, do_sample=False, eos_token_id=list(range(3, 80)),
             output_logprobs=True),
        dict(max_new_tokens=7, do_sample=False, repetition_penalty=1.5, eos_token_id=None),
        dict(max_new_tokens=9, do_sample=True, temperature=0.8, top_k=20, seed=11, eos_token_id=None,
             num_return_sequences=2),
    ]
    prompts = random_prompts(n, 2, 20, seed=seed)
    return [(p, GenerationConfig(**kinds[i % len(kinds)])) for i, p in enumerate(prompts)]


def make_engine(async_scheduling: bool, num_blocks: int = 200) -> hf_paged.Engine:
    return hf_paged.Engine(models(ARCH)[1], num_blocks=num_blocks, block_size=4, max_batch_tokens=40, max_num_seqs=6,
                           async_scheduling=async_scheduling)


def check_consistent(engine: hf_paged.Engine, done: dict) -> None:
    engine.scheduler.check_invariants()  # every held block belongs to a live sequence, reference counts match
    alloc = engine.block_manager.allocator
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    assert not set(engine.requests.open) & set(done), "a reported request is still live"


def drive(engine: hf_paged.Engine, requests, on_step=None) -> tuple[dict, int]:
    """Add ``requests``, step until done (a KeyboardInterrupt from a step is caught and stepping goes on)."""
    ids = [engine.add_request(p, c) for p, c in requests]
    done, interrupts, step = {}, 0, 0
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            outs, interrupts = [], interrupts + 1
        step += 1
        for out in outs:
            assert out.request_id not in done, f"{out.request_id} reported twice"
            done[out.request_id] = out
        check_consistent(engine, done)
        if on_step is not None:
            on_step(engine, step, ids)
    assert engine.stats()["used_blocks"] == 0 and not engine.requests.open
    return done, interrupts


@pytest.fixture(scope="module")
def clean():
    """Outputs of the fault-free run, per scheduling mode (they are the same in both)."""
    out = {}
    for mode in (False, True):
        done, _ = drive(make_engine(mode), workload())
        out[mode] = {rid: (o.token_ids, o.finish_reason) for rid, o in done.items()}
    assert out[False] == out[True] and len(out[False]) == 12
    return out[False]


class FailOnce:
    """Wraps ``fn``: call number ``at`` (from 1) raises ``error`` instead of running."""

    def __init__(self, fn, at: int, error: BaseException):
        self.fn, self.at, self.error, self.calls = fn, at, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.fn(*args, **kwargs)


@ASYNC
@pytest.mark.parametrize("where", ["forward", "sampler"])
@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("at", [1, 4, 9])
def test_a_fault_in_the_device_work_changes_no_output(clean, async_scheduling, where, error, at):
    engine = make_engine(async_scheduling)
    if where == "forward":
        engine.runner.forward = FailOnce(engine.runner.forward, at, error)
    else:
        engine.sampler = FailOnce(engine.sampler, at, error)
    done, interrupts = drive(engine, workload())
    assert interrupts == isinstance(error, KeyboardInterrupt)
    assert {rid: (o.token_ids, o.finish_reason) for rid, o in done.items()} == clean


@ASYNC
def test_a_request_that_makes_the_model_fail_ends_with_an_error_and_no_other_is_touched(clean, async_scheduling):
    requests = workload()
    poison = random_prompts(1, 36, 36, seed=99)[0]  # the only sequence ever to reach position 35
    engine = make_engine(async_scheduling)
    forward = engine.runner.forward

    def failing_forward(plan):
        if int(plan.position_ids.max()) >= 35:
            raise RuntimeError("poisoned input")
        return forward(plan)

    engine.runner.forward = failing_forward
    done, _ = drive(engine, requests[:3] + [(poison, GenerationConfig(max_new_tokens=3))] + requests[3:])
    bad = done.pop("3")
    assert bad.finish_reason == "error" and "poisoned input" in bad.error
    renumbered = {_shift(rid): out for rid, out in done.items()}  # ids after the poisoned one moved up by one
    assert {rid: (o.token_ids, o.finish_reason) for rid, o in renumbered.items()} == clean


def _shift(rid: str) -> str:
    base, mark, copy = rid.partition("__child#")
    base = str(int(base) - 1) if int(base) > 3 else base
    return base + mark + copy


@ASYNC
def test_a_stop_check_that_raises_ends_only_its_request(clean, async_scheduling):
    engine = make_engine(async_scheduling)
    check = engine._stop_reason

    def finish_reason(seq):
        if seq.request_id == "2" and seq.num_generated == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return check(seq)

    engine._stop_reason = finish_reason
    done, _ = drive(engine, workload())
    assert done["2"].finish_reason == "error" and "injected" in done["2"].error
    assert done["2"].token_ids == clean["2"][0][:3]
    del done["2"]
    assert {rid: (o.token_ids, o.finish_reason) for rid, o in done.items()} == {
        rid: v for rid, v in clean.items() if rid != "2"}


@ASYNC
@pytest.mark.parametrize("at", [2, 5, 11])
def test_ctrl_c_during_the_bookkeeping_waits_for_a_consistent_state(clean, async_scheduling, at):
    """A real SIGINT in the middle of writing a step's tokens into its sequences is raised when the step is done;
    before the fix it could leave a placeholder in a sequence or skip its stop check."""
    engine = make_engine(async_scheduling, num_blocks=30)  # tight: preemptions too
    check = engine._stop_reason
    calls = []

    def finish_reason(seq):
        calls.append(seq.request_id)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return check(seq)

    engine._stop_reason = finish_reason
    done, interrupts = drive(engine, workload())
    assert interrupts == 1
    assert {rid: (o.token_ids, o.finish_reason) for rid, o in done.items()} == clean


@ASYNC
def test_outputs_queued_before_a_failed_step_are_reported_by_the_next_one(async_scheduling):
    engine = make_engine(async_scheduling)
    a = engine.add_request([5, 6, 7], GenerationConfig(max_new_tokens=20, eos_token_id=None))
    b = engine.add_request([8, 9], GenerationConfig(max_new_tokens=20, eos_token_id=None))
    engine.step()
    engine.abort(a)
    too_long = engine.add_request([5] * 600, GenerationConfig(max_new_tokens=2))  # fails at the door
    engine.runner.forward = FailOnce(engine.runner.forward, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    check_consistent(engine, {})
    outs = {o.request_id: o for o in engine.step()}
    assert outs[a].finish_reason == "abort" and outs[too_long].finish_reason == "error"
    engine.abort(b)
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert [o.request_id for o in rest] == [b] and engine.stats()["used_blocks"] == 0


@ASYNC
def test_a_tokenizer_that_cannot_decode_a_requests_tokens_ends_only_that_request(async_scheduling):
    """Its output and its last delta say "error" (they said "length" with no text); the others get their text."""
    prompts = random_prompts(3, 3, 9, seed=12)
    prompts.insert(1, prompts[0])  # the same prompt twice: with and without stop strings (whose check decodes)
    refs = hf_greedy(ARCH, prompts, 6)
    bad = next(t for t in refs[0] if all(t not in r for r in refs[2:]))  # in the first two outputs only

    class Picky:
        def decode(self, ids, skip_special_tokens=True):
            if bad in ids:
                raise ValueError(f"no text for token {bad}")
            return " ".join(map(str, ids))

    engine = hf_paged.Engine(models(ARCH)[1], num_blocks=64, block_size=4, tokenizer=Picky(),
                             async_scheduling=async_scheduling)
    configs = [GenerationConfig(max_new_tokens=6, do_sample=False, stop_strings=s) for s in (None, ["zz"], None, ["zz"])]
    outs = engine.generate(prompts, configs)
    assert outs[0].token_ids == refs[0]  # (it fails once done, when its text is made)
    assert outs[1].token_ids == refs[1][: refs[1].index(bad) + 1]  # (its stop check fails at the token)
    for out in outs[:2]:
        assert out.finish_reason == "error" and f"no text for token {bad}" in out.error and out.text is None
    for out, ref in zip(outs[2:], refs[2:]):
        assert out.token_ids == ref and out.finish_reason != "error" and out.text == " ".join(map(str, ref))
    last = {}
    for delta in engine.stream(prompts, configs):
        last[delta.request_id] = delta
    assert [last[rid].finish_reason == "error" for rid in sorted(last, key=int)] == [True, True, False, False]
    assert engine.stats()["used_blocks"] == 0 and not engine.has_unfinished()
