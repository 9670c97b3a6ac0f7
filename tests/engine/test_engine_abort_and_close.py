"""No wedged engine: ``abort_all``, a ``generate`` that aborts its requests when interrupted, a ``stream`` that aborts
its requests when its consumer stops, and outputs of requests that are not the reader's own kept for their reader."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts

ARCH = "llama_gqa"
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make_engine(async_scheduling: bool, **kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(models(ARCH)[1], **{"num_blocks": 100, "block_size": 4, "max_batch_tokens": 32,
                                               "async_scheduling": async_scheduling, **kwargs})


def assert_idle(engine: hf_paged.Engine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished() and not engine.requests.open, engine.requests.open
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    engine.scheduler.check_invariants()


def step_all(engine: hf_paged.Engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in done
            done[out.request_id] = out
    return done


class InterruptAt:
    def __init__(self, fn, at: int):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*args)


@ASYNC
def test_abort_all_stops_every_request_and_reports_each_once(async_scheduling):
    prompts = random_prompts(5, 3, 14, seed=1)
    engine = make_engine(async_scheduling)
    ids = [engine.add_request(p, greedy_config(30)) for p in prompts[:4]]
    ids.append(engine.add_request(prompts[4], GenerationConfig(max_new_tokens=30, do_sample=True, seed=1,
                                                               num_return_sequences=3)))
    for _ in range(3):
        engine.step()
    stopped = engine.abort_all()
    assert set(ids) <= set(stopped) and len(stopped) == 7
    done = step_all(engine)
    assert sorted(done) == sorted(stopped) and {o.finish_reason for o in done.values()} == {"abort"}
    assert_idle(engine)
    assert [o.token_ids for o in engine.generate(prompts, greedy_config(5))] == hf_greedy(ARCH, prompts, 5)


@ASYNC
@pytest.mark.parametrize("at", [1, 3, 6])
def test_an_interrupted_generate_aborts_its_requests_and_the_next_one_works(async_scheduling, at):
    prompts = random_prompts(6, 3, 20, seed=2)
    engine = make_engine(async_scheduling)
    engine.runner.forward = InterruptAt(engine.runner.forward, at)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, greedy_config(8))
    assert_idle(engine)
    assert [o.token_ids for o in engine.generate(prompts, greedy_config(8))] == hf_greedy(ARCH, prompts, 8)
    assert_idle(engine)


@ASYNC
def test_generate_reports_only_its_own_requests_and_keeps_the_others_for_step(async_scheduling):
    prompts = random_prompts(4, 3, 12, seed=3)
    refs = hf_greedy(ARCH, prompts, 6)
    engine = make_engine(async_scheduling)
    other = engine.add_request(prompts[0], greedy_config(3))  # finishes while generate runs
    outs = engine.generate(prompts[1:], greedy_config(6))
    assert [o.token_ids for o in outs] == refs[1:] and other not in {o.request_id for o in outs}
    assert engine.has_unfinished()
    assert step_all(engine)[other].token_ids == refs[0][:3]
    assert_idle(engine)


@ASYNC
@pytest.mark.parametrize("stop_after", [1, 4, 9])
def test_closing_a_stream_aborts_its_own_requests_and_keeps_the_others(async_scheduling, stop_after):
    prompts = random_prompts(6, 3, 16, seed=4)
    refs = hf_greedy(ARCH, prompts, 7)
    engine = make_engine(async_scheduling)
    other = engine.add_request(prompts[0], greedy_config(7))
    stream = engine.stream(prompts[1:], greedy_config(7))
    seen = []
    for delta in stream:
        seen.append(delta)
        assert delta.request_id != other, "a stream with prompts yields only its own requests"
        if len(seen) == stop_after:
            break
    stream.close()
    assert not any(engine.requests.is_open(str(i)) for i in range(1, 6))
    done = step_all(engine)
    assert list(done) == [other] and done[other].token_ids == refs[0]
    assert_idle(engine)


@ASYNC
def test_a_reader_that_stops_drops_nothing_it_did_not_receive(async_scheduling):
    """Five requests finish in the same step; the stream's consumer stops after the first finished delta. The
    other four (added with add_request: not the stream's to abort) reach the next reader, each exactly once,
    with every token once in order."""
    prompts = random_prompts(5, 6, 6, seed=5)
    refs = hf_greedy(ARCH, prompts, 4)
    engine = make_engine(async_scheduling)
    ids = [engine.add_request(p, greedy_config(4)) for p in prompts]
    tokens, finished = {rid: [] for rid in ids}, []
    for delta in engine.stream():
        tokens[delta.request_id] += delta.token_ids
        if delta.finished:
            finished.append(delta.request_id)
            break
    for delta in engine.stream():  # a second reader gets what the first did not take
        tokens[delta.request_id] += delta.token_ids
        if delta.finished:
            finished.append(delta.request_id)
    assert sorted(finished) == sorted(ids) and [tokens[i] for i in ids] == refs
    assert_idle(engine)
    again = [engine.add_request(p, greedy_config(4)) for p in prompts]
    for delta in engine.stream():
        if delta.finished:
            break
    done = step_all(engine)  # or step(): the outputs not streamed come from it
    assert len(done) == 4 and all(done[i].token_ids == r for i, r in zip(again, refs) if i in done)
    assert_idle(engine)


@ASYNC
def test_close_frees_every_block_and_refuses_later_calls(async_scheduling):
    engine = make_engine(async_scheduling)
    prompts = random_prompts(4, 3, 14, seed=3)
    engine.add_requests(prompts, greedy_config(20))
    for _ in range(4):  # some requests mid-decode, one step in flight under async scheduling
        engine.step()
    assert engine.stats()["used_blocks"] > 0
    engine.close()
    assert engine.closed and engine.runner.graphs is None
    stats = engine.stats()  # still answers
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    engine.scheduler.check_invariants()
    for call in (lambda: engine.add_request(prompts[0]), engine.step, lambda: engine.generate(prompts[:1]),
                 lambda: list(engine.stream(prompts[:1]))):
        with pytest.raises(RuntimeError, match=r"closed \(Engine.close\(\)\); create a new Engine"):
            call()
    engine.close()  # a second call does nothing


def test_an_engine_used_as_a_context_manager_closes_on_exit_and_on_error():
    with make_engine(False) as engine:
        outputs = engine.generate(random_prompts(2, 3, 9, seed=4), greedy_config(3))
    assert engine.closed and len(outputs) == 2
    with pytest.raises(ValueError, match="boom"), make_engine(False) as failing:
        failing.add_request(random_prompts(1, 3, 9, seed=5)[0], greedy_config(5))
        raise ValueError("boom")
    assert failing.closed and failing.stats()["used_blocks"] == 0


def test_a_failure_to_close_does_not_hide_the_error_that_left_the_block(monkeypatch, caplog):
    engine = make_engine(False)
    monkeypatch.setattr(engine, "abort_all", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(ValueError, match="the block's own"), engine:
        raise ValueError("the block's own")
    assert "closing the engine after ValueError failed too (RuntimeError: device lost)" in caplog.text
    with pytest.raises(RuntimeError, match="device lost"), engine:  # without an error of its own: raised
        pass
