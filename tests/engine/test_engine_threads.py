"""The thread contract: ``add_request`` and ``abort`` (and ``abort_all``, ``has_unfinished``, ``stats``) may be
called from any thread while one thread steps; ``step``/``stream``/``generate`` from one thread at a time.

Checked with a randomised three-thread run (one thread steps, one adds, one aborts) against the model's greedy
tokens, and with deterministic interleavings inside the device forward (which runs without the engine's lock).
``generate_batch`` from two threads on one model: each call gets what it would get alone.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from tiny_models import EOS

ARCH = "llama_gqa"
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
GENERATE_BATCH_CALLS = 20


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread interleavings per step
    yield
    sys.setswitchinterval(old)


def make_engine(async_scheduling: bool, num_blocks: int = 48) -> hf_paged.Engine:
    return hf_paged.Engine(models(ARCH)[1], num_blocks=num_blocks, block_size=4, max_batch_tokens=32, max_num_seqs=6,
                           async_scheduling=async_scheduling)


@ASYNC
@pytest.mark.parametrize("seed", [0, 1])
def test_three_threads_step_add_and_abort_and_every_request_is_reported_once(async_scheduling, seed, fast_switching):
    rng = random.Random(seed)
    prompts = random_prompts(40, 2, 14, seed=100 + seed)
    news = [rng.randint(1, 8) for _ in prompts]
    engine = make_engine(async_scheduling)  # 48 blocks of 4: preemptions too
    added: dict[str, int] = {}
    adding_done, stop = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def adder():
        try:
            for i, p in enumerate(prompts):
                added[engine.add_request(p, greedy_config(news[i]), request_id=f"r{i}")] = i
                time.sleep(rng.random() * 2e-3)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            adding_done.set()

    aborted: set[str] = set()

    def aborter():
        arng = random.Random(seed + 7)
        try:
            while not stop.is_set():
                rid = f"r{arng.randrange(len(prompts) + 5)}"  # sometimes unknown or finished already
                if arng.random() < 0.3:
                    engine.abort(rid)
                    aborted.add(rid)
                engine.has_unfinished(), engine.stats()
                time.sleep(arng.random() * 3e-3)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=adder), threading.Thread(target=aborter)]
    for t in threads:
        t.start()
    done = {}
    try:
        while not adding_done.is_set() or engine.has_unfinished():
            for out in engine.step():
                assert out.request_id not in done, f"{out.request_id} reported twice"
                done[out.request_id] = out
            engine.check_invariants()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert sorted(done) == sorted(added), "every request added is reported exactly once"
    assert engine.stats()["used_blocks"] == 0 and not engine.requests.open
    refs = hf_greedy(ARCH, prompts, 8)
    for rid, out in done.items():
        want = refs[added[rid]][: news[added[rid]]]
        if out.finish_reason == "abort":
            assert rid in aborted and out.token_ids == want[: len(out.token_ids)]
        else:
            assert out.token_ids == want and out.finish_reason == ("stop" if want[-1] == EOS else "length")


@ASYNC
def test_the_device_forward_runs_without_the_lock(async_scheduling):
    """While the forward runs, another thread adds a request and aborts one of the batch without waiting."""
    prompts = random_prompts(4, 3, 10, seed=3)
    refs = hf_greedy(ARCH, prompts, 6)
    engine = make_engine(async_scheduling, num_blocks=100)
    ids = [engine.add_request(p, greedy_config(6)) for p in prompts[:3]]
    forward, calls, late = engine.runner.forward, [], []

    def forward_with_a_visitor(plan):
        calls.append(1)
        if len(calls) == 3:
            visitor = threading.Thread(target=lambda: (engine.abort(ids[1]),
                                                       late.append(engine.add_request(prompts[3], greedy_config(6)))))
            visitor.start()
            visitor.join(timeout=10)
            assert not visitor.is_alive(), "add_request/abort waited for the forward"
        return forward(plan)

    engine.runner.forward = forward_with_a_visitor
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    assert done[ids[1]].finish_reason == "abort" and done[ids[1]].token_ids == refs[1][: len(done[ids[1]].token_ids)]
    assert [done[i].token_ids for i in (ids[0], ids[2], late[0])] == [refs[0], refs[2], refs[3]]
    assert engine.stats()["used_blocks"] == 0


def test_a_second_stepping_thread_is_refused():
    engine = make_engine(False, num_blocks=100)
    engine.add_request([5, 6, 7], greedy_config(4))
    forward, refused = engine.runner.forward, []

    def forward_while_another_steps(plan):
        if not refused:
            other = threading.Thread(target=lambda: refused.append(_raises(engine.step)))
            other.start()
            other.join(timeout=10)
        return forward(plan)

    engine.runner.forward = forward_while_another_steps
    while engine.has_unfinished():
        engine.step()
    assert isinstance(refused[0], RuntimeError) and "one thread" in str(refused[0])


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def test_a_stream_collected_inside_a_step_is_cancelled_at_the_next_consistent_point():
    """A stream generator caught in a reference cycle is closed by the garbage collector wherever it runs, even
    inside a step of the same thread: the abort of its requests must wait for the step, not deadlock it."""
    import gc

    engine = make_engine(False, num_blocks=100)
    prompts = random_prompts(3, 3, 9, seed=4)
    stream = engine.stream(prompts, greedy_config(20))
    next(stream)
    own = [f for f in engine.requests._family_size]
    forward = engine.runner.forward
    holder = {"stream": stream}
    holder["self"] = holder  # a cycle: only the cyclic collector frees it
    del stream, holder

    def forward_that_collects(plan):
        gc.collect()  # runs the stream's finally inside this step
        return forward(plan)

    engine.runner.forward = forward_that_collects
    other = engine.add_request(prompts[0], greedy_config(3))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    engine.runner.forward = forward
    assert list(done) == [other] and not any(engine.requests.is_open(f) for f in own)
    assert engine.stats()["used_blocks"] == 0


def test_two_threads_calling_generate_batch_on_one_model_get_single_thread_results(fast_switching):
    """Calls of ``generate_batch`` from several threads run one at a time (the second waits for the first to end),
    so each gets the tokens it would get alone, with a kept engine or without."""
    model = models(ARCH)[1]
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    work = [random_prompts(3, 3, 12, seed=110 + t) for t in range(2)]
    expected = [hf_greedy(ARCH, prompts, 4) for prompts in work]
    got: list[list] = [[], []]
    errors: list[BaseException] = []

    def caller(t: int):
        try:
            for call in range(GENERATE_BATCH_CALLS):
                results = hf_paged.generate_batch(model, work[t], config, persistent_manager=call % 4 != 3)
                got[t].append([r.generated_tokens for r in results.values()])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert got == [[expected[t]] * GENERATE_BATCH_CALLS for t in range(2)]
    assert model.config._attn_implementation == "hf_paged"  # (the model's own, put back by each call)
    hf_paged.generate_batch(model, work[0], config)  # (lets the kept engine go)
