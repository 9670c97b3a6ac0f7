"""A seeded randomised soak of the engine under faults (CPU, well under a minute per scheduling mode).

One thread steps: plain ``step()`` calls and ``stream()`` sessions whose consumers often stop early. Meanwhile
the model forward raises now and then (a transient fault, a Ctrl-C, or always for the "poisoned" requests that
reach position 35), a real SIGINT lands in the middle of the bookkeeping now and then, and a second thread aborts
random requests (live, finished or unknown). After every step and every delta the engine's bookkeeping is checked
(free + used blocks make the pool, reference counts match the live tables, no open request without an owner); at
the end every request was reported exactly once (or dropped with the stream that owned it), and each one that
finished normally has the tokens of running it alone.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from hf_paged.engine._request_registry import family

pytestmark = pytest.mark.slow  # the soak

ARCH = "llama_gqa"
POISON_POSITION = 35  # only poisoned prompts are that long; the others stay below it (20 + 10 new tokens)


class FaultyForward:
    """The runner's forward, raising at random (seeded) and always on a poisoned position."""

    def __init__(self, forward, rng: random.Random):
        self.forward, self.rng, self.faults = forward, rng, 0

    def __call__(self, plan):
        if int(plan.position_ids.max()) >= POISON_POSITION:
            raise RuntimeError("poisoned input")
        roll = self.rng.random()
        if roll < 0.03:
            self.faults += 1
            raise RuntimeError("injected transient fault")
        if roll < 0.04:
            self.faults += 1
            raise KeyboardInterrupt
        return self.forward(plan)


class Soak:
    def __init__(self, async_scheduling: bool, seed: int):
        self.rng = random.Random(seed)
        self.engine = hf_paged.Engine(models(ARCH)[1], num_blocks=24, block_size=4, max_batch_tokens=40,
                                      max_num_seqs=8, async_scheduling=async_scheduling)
        self.engine.runner.forward = FaultyForward(self.engine.runner.forward, random.Random(seed + 1))
        check = self.engine._stop_reason
        sig_rng = random.Random(seed + 2)

        def finish_reason(seq):  # a real Ctrl-C in the middle of taking in a step's tokens, now and then
            if sig_rng.random() < 0.004:
                os.kill(os.getpid(), signal.SIGINT)
            return check(seq)

        self.engine._stop_reason = finish_reason
        self.requests: dict[str, tuple[list[int], GenerationConfig]] = {}  # every request added, by id
        self.step_owned: set[str] = set()  # added with add_request, not reported yet
        self.stream_owned: set[str] = set()  # owned by the stream session running now
        self.reported: dict[str, object] = {}  # sequence id -> RequestOutput, or the final TokenDelta's tokens
        self.dropped: set[str] = set()  # families whose stream closed before they finished
        self.ids_for_aborter: list[str] = []
        self.counter = 0

    def new_request(self) -> tuple[list[int], GenerationConfig]:
        self.counter += 1
        r = self.rng.random()
        if r < 0.05:
            return random_prompts(1, 36, 36, seed=self.counter)[0], greedy_config(3)  # poisoned
        prompt = random_prompts(1, 2, 20, seed=self.counter)[0]
        if r < 0.2:
            return prompt, GenerationConfig(max_new_tokens=self.rng.randint(1, 10), do_sample=True, top_k=20,
                                            seed=self.counter, num_return_sequences=self.rng.choice([1, 2]))
        return prompt, greedy_config(self.rng.randint(1, 10))

    def check(self) -> None:
        self.engine.check_invariants()
        open_families = {family(rid) for rid in list(self.engine.requests.open)}
        assert open_families <= self.step_owned | self.stream_owned, "an open request without an owner"

    def report(self, rid: str, value) -> None:
        assert rid not in self.reported, f"{rid} reported twice"
        self.reported[rid] = value

    def step(self) -> None:
        try:
            outs = self.engine.step()
        except KeyboardInterrupt:  # what the step took out comes from the next step: its requests keep their reader
            self.check()
            return
        for out in outs:
            assert family(out.request_id) in self.step_owned, f"{out.request_id} reported to the wrong reader"
            self.report(out.request_id, out)
        self.step_owned -= {f for f in self.step_owned if not self.engine.requests.is_open(f)}
        self.check()

    def stream_session(self) -> None:
        """A ``stream(prompts)`` whose consumer often stops early; its requests are its own (queued when the
        generator starts: the open ids that appear then)."""
        batch = [self.new_request() for _ in range(self.rng.randint(1, 3))]
        stop_after = self.rng.choice([None, 1, 2, 5, 10])
        before = set(self.engine.requests.open)
        stream = self.engine.stream([p for p, _ in batch], [c for _, c in batch])
        tokens: dict[str, list[int]] = {}
        try:
            for n, delta in enumerate(stream, 1):
                if n == 1:
                    own = {family(r) for r in self.engine.requests.open if r not in before} - self.step_owned
                    self.requests.update(zip(sorted(own, key=int), batch))
                    self.stream_owned = own
                    self.ids_for_aborter += sorted(own)
                assert family(delta.request_id) in self.stream_owned, "a stream yielded a request it does not own"
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finished:
                    self.report(delta.request_id, (tokens[delta.request_id], delta.finish_reason))
                self.check()
                if n == stop_after:
                    break
        except KeyboardInterrupt:
            pass
        stream.close()
        self.dropped |= {f for f in self.stream_owned if f not in self.reported}
        assert not any(self.engine.requests.is_open(f) for f in self.stream_owned), "a closed stream left some open"
        self.stream_owned = set()
        self.check()

    def run(self, rounds: int) -> None:
        stop = threading.Event()
        aborter = threading.Thread(target=self.abort_at_random, args=(stop,))
        aborter.start()
        try:
            for _ in range(rounds):
                roll = self.rng.random()
                if roll < 0.3:
                    for _ in range(self.rng.randint(1, 4)):
                        prompt, config = self.new_request()
                        rid = self.engine.add_request(prompt, config)
                        self.requests[rid] = (prompt, config)
                        self.step_owned.add(rid)
                        self.ids_for_aborter.append(rid)
                elif roll < 0.42:
                    self.stream_session()
                self.step()
            while self.engine.has_unfinished():
                self.step()
        finally:
            stop.set()
            aborter.join()
        assert not self.step_owned and not self.engine.requests.open
        assert self.engine.stats()["used_blocks"] == 0

    def abort_at_random(self, stop: threading.Event) -> None:
        rng = random.Random(self.rng.random())
        while not stop.is_set():
            time.sleep(rng.random() * 0.005)
            if self.ids_for_aborter and rng.random() < 0.05:  # mostly recent requests: live ones
                self.engine.abort(rng.choice(self.ids_for_aborter[-8:] + ["no-such-id"]))


def alone(rid: str, prompt: list[int], config: GenerationConfig) -> dict[str, list[int]]:
    """The oracle for a sampled request: the engine running it alone (its seed makes it reproducible)."""
    engine = hf_paged.Engine(models(ARCH)[1], num_blocks=40, block_size=4, async_scheduling=False)
    engine.add_request(prompt, config, request_id=rid)
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step()})
    return out


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread, and lose much to it on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_soak_with_faults_aborts_and_early_stopping_streams(async_scheduling, one_torch_thread):
    soak = Soak(async_scheduling, seed=1234 + async_scheduling)
    soak.run(rounds=400)
    assert soak.engine.runner.forward.faults > 3 and soak.engine.stats()["preemptions"] > 0
    reasons = {}
    for rid, got in soak.reported.items():
        tokens, reason = (got.token_ids, got.finish_reason) if hasattr(got, "token_ids") else got
        reasons[reason] = reasons.get(reason, 0) + 1
        prompt, config = soak.requests[family(rid)]
        want = (hf_greedy(ARCH, [prompt], config.max_new_tokens)[0] if not config.do_sample
                else alone(family(rid), prompt, config)[rid])
        if reason in ("stop", "length"):
            assert tokens == want, rid
        else:
            assert reason in ("abort", "error") and tokens == want[: len(tokens)], (rid, reason)
            if reason == "error" and hasattr(got, "error"):
                assert "poisoned input" in got.error or "injected" in got.error, got.error
    every = set(soak.requests) - soak.dropped
    assert every <= set(soak.reported), "a request neither reported nor dropped with its stream"
    assert reasons.get("abort") and reasons.get("error") and reasons.get("length")
