"""The token hand-over commits all or nothing whatever delivers a ``KeyboardInterrupt``: the default SIGINT handler,
an application's own handler, asyncio's (its second Ctrl-C raises), an exception raised from a SIGALRM handler.

A trace function counts the lines the engine runs while it takes a step's tokens into its sequences (and commits the
step, checks stops, forks copies) and sends the signal at a chosen line: at a different line of every other step, so
that a run visits the hand-over's lines one after the other. After every step the bookkeeping must be consistent; at
the end every request must have been reported once, with the tokens and text of an undisturbed run: never the
placeholder -1 as a token, never a request left running.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged.cli.default_model import byte_tokenizer
from hf_paged.engine import _core, _engine, _request_output
from hf_paged.engine._sequence import PLACEHOLDER

ARCH = "llama_gqa"
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
#: The hand-over: taking in a step's tokens, committing it, stop checks, forks, handing outputs over.
HAND_OVER = {f.__code__ for f in (
    _core.EngineCore._resolve, _core.EngineCore._take_tokens, _core.EngineCore._commit,
    _core.EngineCore._fork, _core.EngineCore._stop_reason,
    _engine.Engine._step, _request_output.output_of)}


def workload(stop: str) -> list[tuple[list[int], GenerationConfig]]:
    """Greedy rows long enough for many decode steps, early EOS with logprobs, a stop string, seeded copies."""
    prompts = random_prompts(5, 3, 12, seed=8)
    kinds = [dict(max_new_tokens=24, eos_token_id=None), dict(max_new_tokens=10, eos_token_id=list(range(3, 40)),
                                                              output_logprobs=True),
             dict(max_new_tokens=12, eos_token_id=None, stop_strings=[stop]),
             dict(max_new_tokens=8, do_sample=True, seed=3, num_return_sequences=2, eos_token_id=None),
             dict(max_new_tokens=20, eos_token_id=None)]
    return [(p, GenerationConfig(**{"do_sample": False, **k})) for p, k in zip(prompts, kinds)]


def make_engine(async_scheduling: bool) -> hf_paged.Engine:
    return hf_paged.Engine(models(ARCH)[1], num_blocks=40, block_size=4, max_batch_tokens=24, max_num_seqs=4,
                           tokenizer=byte_tokenizer(), async_scheduling=async_scheduling)


class SignalAtLine:
    """A trace function: in every other step (``arm``), the ``n``-th line the hand-over runs sends ``signum``."""

    def __init__(self, signum: int):
        self.signum, self.target, self.count, self.sent = signum, None, 0, 0

    def arm(self, target: int | None) -> None:
        self.target, self.count = target, 0

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code in HAND_OVER else None

    def _line(self, frame, event, arg):
        if event == "line" and self.target is not None:
            self.count += 1
            if self.count == self.target:
                self.sent += 1
                signal.raise_signal(self.signum)
        return self._line


def drive(engine: hf_paged.Engine, requests, tracer: SignalAtLine | None = None) -> tuple[dict, int]:
    """Run ``requests`` to the end, stepping again after each KeyboardInterrupt; check the state after each step."""
    ids = [engine.add_request(p, c) for p, c in requests]
    done, interrupts = {}, 0
    for step in range(400):
        if not engine.has_unfinished():
            break
        if tracer is not None:
            tracer.arm(step // 2 + 1 if step % 2 == 0 else None)
            sys.settrace(tracer)
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            outs, interrupts = [], interrupts + 1
        finally:
            sys.settrace(None)
        for out in outs:
            assert out.request_id not in done, f"{out.request_id} reported twice"
            assert PLACEHOLDER not in out.token_ids, f"{out.request_id} got the placeholder as a token"
            done[out.request_id] = (out.token_ids, out.finish_reason, out.text)
        engine.check_invariants()
        assert all(PLACEHOLDER not in s.token_ids[:-1] for s in engine.scheduler.live), "a placeholder left behind"
    else:
        raise AssertionError("requests still running after 400 steps")
    assert engine.stats()["used_blocks"] == 0 and not engine.requests.open
    assert {rid.partition("__child#")[0] for rid in done} == set(ids)
    return done, interrupts


@pytest.fixture(scope="module")
def stop() -> str:
    """A stop string that the stop-string row meets halfway through its text."""
    engine = make_engine(False)
    prompt, config = workload("unused")[2]
    text = engine.generate([prompt], GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))[0].text
    return text[len(text) // 2 : len(text) // 2 + 2]


@pytest.fixture(scope="module")
def clean(stop):
    out = {mode: drive(make_engine(mode), workload(stop))[0] for mode in (False, True)}
    assert out[False] == out[True] and any(r == "stop" for _, r, _ in out[False].values())
    return out[False]


def raising_handler(signum, frame):
    raise KeyboardInterrupt


@pytest.fixture
def handler():
    """Restore the signal handlers a test installs."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGALRM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@ASYNC
@pytest.mark.parametrize("delivery", ["default SIGINT", "own SIGINT handler", "SIGALRM handler"])
def test_an_interrupt_at_any_line_of_the_hand_over_commits_all_or_nothing(clean, stop, handler, async_scheduling,
                                                                         delivery):
    signum = signal.SIGALRM if delivery == "SIGALRM handler" else signal.SIGINT
    if delivery != "default SIGINT":
        signal.signal(signum, raising_handler)
    tracer = SignalAtLine(signum)
    done, interrupts = drive(make_engine(async_scheduling), workload(stop), tracer)
    assert tracer.sent >= 15 and interrupts == tracer.sent
    assert done == clean


def test_asyncios_second_ctrl_c_waits_for_the_hand_over_too(clean, stop, handler):
    """Inside ``asyncio.run``, SIGINT goes to asyncio's handler: the first one cancels the main task, each later one
    raises KeyboardInterrupt on the spot (here: inside the engine's step, which the coroutine runs)."""
    result = {}

    async def main():
        signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: asyncio cancels this task at its next await
        tracer = SignalAtLine(signal.SIGINT)
        result["done"], result["interrupts"] = drive(make_engine(True), workload(stop), tracer)
        result["sent"] = tracer.sent

    with pytest.raises((KeyboardInterrupt, asyncio.CancelledError)):
        asyncio.run(main())
    assert result["sent"] >= 15 and result["interrupts"] == result["sent"]
    assert result["done"] == clean
