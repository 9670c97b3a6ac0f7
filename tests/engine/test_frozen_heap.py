"""``generate_batch`` and ``Engine.generate`` set the objects that exist when they start aside from the garbage
collector for the call (``hf_paged/_frozen_heap.py``), so that a full collection inside it walks only what the call
made, and put them back after: nothing is kept from collection once the call is over, and a process's own freeze is
left as it is (the call then holds off full collections instead)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged.engine import _validation as validation
from hf_paged.engine._engine import Engine
from hf_paged._frozen_heap import frozen_heap

CONFIG = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def _nothing_frozen():
    assert gc.isenabled() and gc.get_freeze_count() == 0, "a test before this one left objects frozen"
    yield
    gc.unfreeze()  # (a failing test must not leave the rest of the session frozen)
    gc.enable()


@pytest.fixture
def seen_during_steps(monkeypatch):
    """Per engine step: (objects in the permanent generation, whether ``old`` is among the collector's objects)."""
    seen, old = [], _Cycle()
    step = Engine._step

    def recorded(self, *args, **kwargs):
        seen.append((gc.get_freeze_count(), any(o is old for o in gc.get_objects())))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "_step", recorded)
    return seen


def test_generate_batch_sets_old_objects_aside_while_it_steps_and_puts_them_back(seen_during_steps, monkeypatch):
    _, paged = models("llama_gqa")
    before = weakref.ref(_Cycle())  # a reference cycle made before the call, garbage already
    checks, check = [], validation.prompt_list
    monkeypatch.setattr(validation, "prompt_list", lambda *a: checks.append(gc.get_freeze_count()) or check(*a))
    results = hf_paged.generate_batch(paged, random_prompts(3, 3, 9, seed=1), CONFIG)
    assert len(results) == 3 and all(len(r.generated_tokens) == 4 for r in results.values())
    assert checks and checks[0] > 1000  # from the call's first line: the prompts' checks allocate too
    assert seen_during_steps and all(frozen > 1000 and not tracked for frozen, tracked in seen_during_steps)
    assert gc.get_freeze_count() == 0  # put back
    gc.collect()
    assert before() is None  # and collected as usual once the call is over


def test_engine_generate_sets_old_objects_aside_too(seen_during_steps):
    _, paged = models("llama_gqa")
    engine = Engine(paged, num_blocks=32)
    outs = engine.generate(random_prompts(2, 3, 9, seed=2), CONFIG)
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert seen_during_steps and all(frozen > 1000 and not tracked for frozen, tracked in seen_during_steps)
    assert gc.get_freeze_count() == 0
    engine.step()  # a step of the user's own is not a call of the engine's: nothing set aside
    assert seen_during_steps[-1] == (0, True)


def test_a_process_that_froze_objects_of_its_own_keeps_its_freeze(seen_during_steps):
    _, paged = models("llama_gqa")
    mine = _Cycle()
    gc.freeze()
    hf_paged.generate_batch(paged, random_prompts(2, 3, 9, seed=3), CONFIG)
    assert seen_during_steps and all(count > 1000 for count, _ in seen_during_steps)
    assert not any(o is mine for o in gc.get_objects())  # still frozen: the call did not unfreeze it


def _churn(n: int = 200_000) -> None:
    """Make reference cycles of which the last ~2,000 stay alive a while: they outlive young collections, which
    makes full collections due."""
    alive = []
    for _ in range(n):
        alive.append(_Cycle())
        if len(alive) > 2000:
            del alive[:1000]


def test_a_process_with_a_freeze_of_its_own_gets_no_full_collection_inside_a_call(seen_during_steps):
    _, paged = models("llama_gqa")
    mine = _Cycle()
    gc.freeze()  # the process's own freeze (an interpreter may freeze a few hundred objects at start)
    gc.collect()  # (sizes the collector's "long-lived" count to what is not frozen, so that the churn makes full
    # collections due whatever this process holds)
    thresholds = gc.get_threshold()
    full = []
    record = lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(info["collected"])
    gc.callbacks.append(record)
    try:
        _churn()
        assert full, "the control made no full collection: the churn does not make one due"
        held = [_Cycle()]
        old = weakref.ref(held[0])
        gc.collect()  # (old ones: in the oldest generation, where only a full collection reaches them)
        del held  # garbage from before the call
        full.clear()
        with frozen_heap():
            _churn()
            hf_paged.generate_batch(paged, random_prompts(2, 3, 9, seed=5), CONFIG)
            assert old() is not None
            inside = list(full)
        assert inside == []  # none inside the call (the one it held off may fall right after it)
    finally:
        gc.callbacks.remove(record)
    assert seen_during_steps and gc.get_threshold() == thresholds  # put back
    assert not any(o is mine for o in gc.get_objects())  # the process's freeze stays
    gc.collect()
    assert old() is None  # and what the call held off is collected after it


def test_with_the_collector_off_nothing_is_frozen(seen_during_steps):
    _, paged = models("llama_gqa")
    gc.disable()
    hf_paged.generate_batch(paged, random_prompts(2, 3, 9, seed=4), CONFIG)
    assert {count for count, _ in seen_during_steps} == {0}
    assert not gc.isenabled()


def test_nested_and_concurrent_holders_share_one_freeze():
    entered, release = threading.Event(), threading.Event()
    counts = []

    def other():
        with frozen_heap():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with frozen_heap():
        first = gc.get_freeze_count()
        thread.start()
        assert entered.wait(10)
        with frozen_heap():
            counts.append(gc.get_freeze_count())
        counts.append(gc.get_freeze_count())
    counts.append(gc.get_freeze_count())  # the other thread still holds it
    release.set()
    thread.join(10)
    # (a frozen object freed by its reference count leaves the permanent generation: the counts are not exact)
    assert first > 1000 and len(counts) == 3 and all(count > first - 100 for count in counts)
    assert gc.get_freeze_count() == 0  # the last holder out put everything back


def test_a_call_that_raises_puts_the_objects_back():
    _, paged = models("llama_gqa")
    with pytest.raises(ValueError):
        hf_paged.generate_batch(paged, [[1, 2, 3]], GenerationConfig(max_new_tokens=4, num_beams=2))
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
