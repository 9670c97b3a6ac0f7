"""Signals' handlers may call the engine: they never wait for ever on its lock, and one that raises while ``step()``
hands outputs over loses none of them.

Python runs a signal's handler in the main thread at its next check for signals: when a function starts, after a
call into C returns, at a loop's jump back. Were the main thread holding the engine's lock there, a handler calling
``abort_all()`` or ``stats()`` would wait on it for ever: ``CheckedLock`` raises instead. ``SignalAt`` sends a signal
at a chosen one of those checks through a profile function (``sys.setprofile``, whose ``call`` and ``c_return``
events are the first two kinds); the tests send signals at fixed points of the code that holds the lock, at random
points of whole runs, and at every point from the moment a step has taken its outputs out to its return.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, models, random_prompts
from hf_paged.cli.default_model import byte_tokenizer
from hf_paged.engine import _engine
from hf_paged.engine._interrupts import InterruptGuard

ARCH = "llama_gqa"
CALLS = {"abort_all": signal.SIGTERM, "stats": signal.SIGUSR1}  # what a handler calls, on which signal
ENGINE_CODE = os.path.dirname(_engine.__file__)
STEP = _engine.Engine._step.__code__


class Deadlock(BaseException):
    """Not an ``Exception``: raised in the forward, the engine would take it for the model's fault."""


class CheckedLock:
    """The engine's lock, raising ``Deadlock`` where a plain lock would wait for ever: its owner acquiring it."""

    def __init__(self):
        self._lock, self.owner = threading.Lock(), None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.owner == threading.get_ident():
            raise Deadlock("a thread waits for the engine's lock it holds (a signal's handler calling the engine)")
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class Handler:
    """The handler of ``CALLS[name]``: calls ``engine.<name>()``; ``got`` holds each call's result with what the
    engine's own state said just before it (the live sequences, the figures ``stats()`` must return)."""

    def __init__(self, engine: hf_paged.Engine, name: str):
        self.engine, self.name, self.got = engine, name, []
        signal.signal(CALLS[name], self)

    def __call__(self, signum, frame) -> None:
        e = self.engine
        now = {"live": sorted(s.request_id for s in e.scheduler.live), "running": len(e.scheduler.running),
               "waiting": len(e.scheduler.waiting), "generated_tokens": e.counters.generated_tokens}
        self.got.append((getattr(e, self.name)(), now))

    def check(self, done: dict) -> None:
        """Every call returned what it must, and every aborted request ended so."""
        assert len(self.got) == 1, f"the handler ran {len(self.got)} times"
        for result, now in self.got:
            if self.name == "stats":
                assert {k: result[k] for k in ("running", "waiting", "generated_tokens")} == {
                    k: now[k] for k in ("running", "waiting", "generated_tokens")}
            else:
                assert sorted(result) == now["live"], "abort_all stopped what was live"
                assert all(done[rid].finish_reason == "abort" for rid in result)


class SignalAt:
    """A profile function: sends ``signum`` once, at the ``at``-th check for signals in engine code."""

    def __init__(self, signum: int, at: int):
        self.signum, self.at, self.seen = signum, at, 0

    def __call__(self, frame, event, arg) -> None:
        if event in ("call", "c_return") and frame.f_code.co_filename.startswith(ENGINE_CODE):
            self.seen += 1
            if self.seen == self.at:
                sys.setprofile(None)
                signal.raise_signal(self.signum)


class Once:
    """``fn``, sending ``signum`` on its first call: before calling ``fn``, or after it when ``after``."""

    def __init__(self, fn, signum: int, after: bool = False):
        self.fn, self.signum, self.after, self.sent = fn, signum, after, False

    def __call__(self, *args):
        send, self.sent = not self.sent, True
        if send and not self.after:
            signal.raise_signal(self.signum)
        out = self.fn(*args)
        if send and self.after:
            signal.raise_signal(self.signum)
        return out


@pytest.fixture
def handlers():
    """Restore the signal handlers a test installs."""
    saved = {s: signal.getsignal(s) for s in (*CALLS.values(), signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def make_engine(**kwargs) -> hf_paged.Engine:
    engine = hf_paged.Engine(models(ARCH)[1], **{"num_blocks": 60, "block_size": 4, "max_batch_tokens": 32,
                                                 "max_num_seqs": 4, "async_scheduling": False, **kwargs})
    engine._lock = CheckedLock()
    return engine


def step_all(engine: hf_paged.Engine, done: dict | None = None) -> dict:
    done = {} if done is None else done
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported twice"
            done[out.request_id] = out
        engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0 and not engine.requests.open
    return done


def run(engine: hf_paged.Engine, prompts: list[list[int]]) -> tuple[list[str], dict]:
    """Two requests, a step, a third request, ``stats()``, an abort of an unknown id, and steps to the end: every
    place where the main thread takes the engine's lock."""
    ids = [engine.add_request(p, greedy_config(6)) for p in prompts[:2]]
    done = {o.request_id: o for o in engine.step()}
    ids.append(engine.add_request(prompts[2], greedy_config(6)))
    engine.stats()
    engine.abort("no such request")
    step_all(engine, done)
    assert sorted(done) == sorted(ids), "every request reported once"
    return ids, done


#: Where the signal arrives while the main thread holds the engine's lock: the object, the function's name, and
#: whether the signal comes after the call (in the step: after the forward, the bookkeeping only).
POINTS = {"step": (lambda e: e, "_commit", True), "add_request": (lambda e: e.scheduler, "add", False),
          "stats": (lambda e: e.runner, "stats", False), "abort": (lambda e: e.scheduler, "abort", False),
          "stream": (lambda e: _engine, "delta_of", False)}


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("point", POINTS)
def test_a_handler_calling_the_engine_where_the_lock_is_held_returns_and_takes_effect(handlers, monkeypatch, name,
                                                                                      point):
    engine = make_engine()
    handler = Handler(engine, name)
    owner, attr, after = POINTS[point]
    monkeypatch.setattr(owner(engine), attr, Once(getattr(owner(engine), attr), CALLS[name], after))
    prompts = random_prompts(3, 3, 10, seed=1)
    if point == "stream":
        ids = [engine.add_request(p, greedy_config(6)) for p in prompts]
        deltas = list(engine.stream())
        done = {d.request_id: d for d in deltas if d.finished}
        assert sorted(done) == sorted(ids)
    else:
        _, done = run(engine, prompts)
    handler.check(done)
    engine.check_invariants()


def test_a_handler_that_calls_the_engine_during_the_forward_defers_a_second_signal_while_it_holds_the_lock(handlers):
    """The forward runs without the lock, so a handler runs at once there: while its ``abort_all()`` holds the lock,
    a second signal's handler (``stats()``) must wait until it is released."""
    engine = make_engine()
    aborter, counter = Handler(engine, "abort_all"), Handler(engine, "stats")
    engine.runner.forward = Once(engine.runner.forward, CALLS["abort_all"])
    engine.scheduler.abort = Once(engine.scheduler.abort, CALLS["stats"])
    ids = [engine.add_request(p, greedy_config(6)) for p in random_prompts(2, 3, 10, seed=2)]
    done = step_all(engine)
    assert sorted(done) == sorted(ids) and {o.finish_reason for o in done.values()} == {"abort"}
    aborter.check(done)
    counter.check(done)


@pytest.mark.parametrize("name", CALLS)
def test_handlers_calling_the_engine_at_random_points_of_runs_return_and_take_effect(handlers, name):
    """12 runs on one engine, each with the signal at a random check for signals in engine code (no prefix
    caching: every run takes the same path)."""
    engine, rng = make_engine(enable_prefix_caching=False), random.Random(name)
    prompts = random_prompts(3, 3, 10, seed=3)
    count = SignalAt(CALLS[name], at=0)
    sys.setprofile(count)
    try:
        run(engine, prompts)
    finally:
        sys.setprofile(None)
    for _ in range(12):
        handler = Handler(engine, name)
        sys.setprofile(SignalAt(CALLS[name], at=rng.randint(1, count.seen * 9 // 10)))
        try:
            _, done = run(engine, prompts)
        finally:
            sys.setprofile(None)
        handler.check(done)


class InterruptTheHandOver:
    """Sends SIGINT (KeyboardInterrupt) at the ``at``-th check for signals from the return of ``requests.take`` in a
    step to the step's return, ``at`` one more in each step it interrupts, until a step that hands something over
    returns with no check left to try (``swept``).

    No SIGINT is sent while the garbage collector runs: what a handler raises inside a gc callback or a finalizer is
    printed and dropped by Python itself, whoever runs the step (another test's library, such as hypothesis, may have
    left a gc callback in this worker). :meth:`close` takes the sweep's own gc callbacks off again."""

    def __init__(self, engine: hf_paged.Engine):
        self.take, self.at, self.seen, self.swept = engine.requests.take, 1, 0, False
        self.with_outputs = 0  # interrupts after the take had taken outputs out
        self.taken = 0
        self.step = 0  # the caller's step count, so that a SIGINT no step raised for can be named
        self.sent: dict[int, list[tuple]] = {}  # step -> where its SIGINTs were sent (function, file, line, event)
        engine.requests.take = self._take
        self.collecting = False
        gc.callbacks.insert(0, self._gc_first)  # called before any other callback, and after them:
        gc.callbacks.append(self._gc_last)
        self._own = {self._gc_first.__func__.__code__, self._gc_last.__func__.__code__}

    def _gc_first(self, phase, info) -> None:
        if phase == "start":
            self.collecting = True

    def _gc_last(self, phase, info) -> None:
        if phase == "stop":
            self.collecting = False

    def close(self) -> None:
        gc.callbacks.remove(self._gc_first)
        gc.callbacks.remove(self._gc_last)

    def _take(self, families=None):
        taken = self.take(families)
        if not self.swept:
            self.seen, self.taken = 0, len(taken)
            sys.setprofile(self._profile)
        return taken

    def _profile(self, frame, event, arg) -> None:
        if event == "return" and frame.f_code is STEP:
            sys.setprofile(None)
            self.swept = arg is not None and bool(arg[0] or arg[1])
        elif event in ("call", "c_return") and not self.collecting and frame.f_code not in self._own:
            self.seen += 1
            if self.seen == self.at:
                sys.setprofile(None)
                self.at += 1
                self.with_outputs += self.taken > 0
                code = frame.f_code
                where = (code.co_name, code.co_filename.rsplit("/", 1)[-1], frame.f_lineno, event, self.seen)
                self.sent.setdefault(self.step, []).append(where)
                signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("deltas", [False, True], ids=["step", "step_with_deltas"])
def test_a_handler_raising_at_any_point_of_the_hand_over_loses_no_output(handlers, deltas):
    """Every check for signals between the take and the return gets a KeyboardInterrupt in turn; the outputs (and
    deltas) must come out exactly once, as in an undisturbed run."""
    requests = [(p, GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None))
                for p, n in zip(random_prompts(5, 3, 10, seed=4), (3, 4, 5, 12, 30))]

    def drive(interrupt: bool) -> tuple[dict, dict, int]:
        engine = make_engine(tokenizer=byte_tokenizer())
        sweep = InterruptTheHandOver(engine) if interrupt else None
        ids = [engine.add_request(p, c) for p, c in requests]
        done, streamed, interrupts, raised = {}, {rid: ([], "") for rid in ids}, 0, set()
        try:
            for step in range(1000):
                if not engine.has_unfinished():
                    break
                if sweep is not None:
                    sweep.step = step
                try:
                    outs, new = engine.step_with_deltas() if deltas else (engine.step(), [])
                except KeyboardInterrupt:
                    interrupts += 1
                    raised.add(step)
                    continue
                for out in outs:
                    assert out.request_id not in done, f"{out.request_id} reported twice"
                    done[out.request_id] = (out.token_ids, out.finish_reason, out.text)
                for d in new:
                    tokens, text = streamed[d.request_id]
                    streamed[d.request_id] = (tokens + d.token_ids, text + (d.text or ""))
                engine.check_invariants()
        finally:
            if sweep is not None:
                sweep.close()
        assert sorted(done) == sorted(ids), "an output was lost"
        assert engine.stats()["used_blocks"] == 0 and not engine.requests.open
        if sweep is not None:
            silent = {step: where for step, where in sweep.sent.items() if step not in raised}
            assert not silent, f"SIGINT sent but no KeyboardInterrupt from the step (step: where it was sent): {silent}"
            twice = {step: where for step, where in sweep.sent.items() if len(where) > 1}
            assert not twice, f"two SIGINTs sent in one step, one KeyboardInterrupt (step: where they were): {twice}"
            assert sweep.swept and sweep.with_outputs >= 10 and interrupts == sweep.at - 1
        return done, streamed, interrupts

    clean, clean_streamed, _ = drive(False)
    done, streamed, interrupts = drive(True)
    assert done == clean and interrupts > 20
    if deltas:
        assert streamed == clean_streamed == {rid: (tokens, text) for rid, (tokens, _, text) in clean.items()}


def test_a_worker_threads_device_work_leaves_the_main_threads_deferred_handlers_to_the_main_thread():
    """One engine stepped from two threads: a signal deferred while the main thread holds the guard runs its handler
    in the main thread as it leaves the guard, never in a worker whose step's device work (``allowed``) ends first."""
    guard, ran_in = InterruptGuard(), []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: ran_in.append(threading.current_thread().name))
    try:
        with guard.held():
            os.kill(os.getpid(), signal.SIGUSR1)  # deferred: the guard holds it

            def device_work():
                with guard.allowed():
                    pass

            worker = threading.Thread(target=device_work, name="worker")
            worker.start()
            worker.join()
            assert ran_in == []  # not run by the worker's allowed()
        assert ran_in == [threading.main_thread().name]
    finally:
        signal.signal(signal.SIGUSR1, previous)
