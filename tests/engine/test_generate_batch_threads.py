"""Two threads calling ``generate_batch`` on one model: the calls of a process run one at a time (the second waits
for the first to end), so each gets the tokens it would get alone, with a kept engine or without."""

from __future__ import annotations

import sys
import threading

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts

ARCH = "llama_gqa"
CALLS = 20


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread interleavings per call
    yield
    sys.setswitchinterval(old)


def test_two_threads_calling_generate_batch_on_one_model_get_single_thread_results(fast_switching):
    model = models(ARCH)[1]
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    work = [random_prompts(3, 3, 12, seed=110 + t) for t in range(2)]
    expected = [hf_greedy(ARCH, prompts, 4) for prompts in work]
    got: list[list] = [[], []]
    errors: list[BaseException] = []

    def caller(t: int):
        try:
            for call in range(CALLS):
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
    assert got == [[expected[t]] * CALLS for t in range(2)]
    assert model.config._attn_implementation == "hf_paged"  # (the model's own, put back by each call)
    hf_paged.generate_batch(model, work[0], config)  # (lets the kept engine go)
