"""Structured output's admission: a schema is compiled once, on the thread that adds the request, and each copy of
``num_return_sequences`` gets a copy of that matcher, so a large schema with many copies holds up no other request's
steps. (Whether the answers match their schema: tests/engine/test_engine_logprobs.py.)"""

from __future__ import annotations

import json
import time

import pytest
from transformers import GenerationConfig

from structured_engine import LARGE_SCHEMA, tiny_engine

pytest.importorskip("llguidance")

@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine()
    # a first request with a schema imports what grammars need (over a second on a CPU): no test times that
    engine.generate(["warm"], GenerationConfig(max_new_tokens=1, json_schema='{"type": "boolean"}'))
    return engine


def test_copies_share_one_compile_and_each_keeps_its_own_state(engine):
    engine.structured.compiled.cache_clear()
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                         "additionalProperties": False})
    config = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, seed=3, num_return_sequences=8,
                              json_schema=schema)
    outs = engine.generate(["one", "two"], config)
    assert engine.structured.compiled.cache_info().misses == 1  # two prompts x 8 copies, one compile
    for out in outs:  # every copy advanced its own matcher: each answer is a whole object of the schema
        assert out.finish_reason == "stop" and json.loads(out.text) in ({"a": True}, {"a": False}), out.text
    fresh = engine.structured.matcher(schema)  # the compiled matcher was copied, never advanced itself
    assert fresh.consume_tokens(outs[0].token_ids) and fresh.is_stopped()


def test_a_large_schema_with_128_copies_does_not_hold_up_a_short_request(engine):
    big = GenerationConfig(max_new_tokens=64, do_sample=True, temperature=1.0, num_return_sequences=128,
                           json_schema=LARGE_SCHEMA)
    # the process's CPU time, not the wall clock: a loaded machine (CI runs three jobs on two cores) stretches the
    # latter by waits that are not this engine's work
    start = time.process_time()
    engine.add_request("Fill in the form:", big, request_id="big")  # compiles the schema here, off the steps
    engine.add_request("hi", GenerationConfig(max_new_tokens=2, do_sample=False), request_id="small")
    done, steps = {}, 0
    while "small" not in done:  # the big request's prompt, then its 128 copies, step beside the small one
        done.update({out.request_id: out for out in engine.step()})
        steps += 1
    waited = time.process_time() - start
    copies = sum(s.request_id.startswith("big") for s in engine.scheduler.live)
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    assert done["small"].finish_reason == "length" and len(done["small"].token_ids) == 2
    assert copies == 128, f"the 128 copies were not running beside the short request ({copies})"
    assert waited < 1.0, f"the 2-token request took {waited:.2f} CPU s ({steps} steps) beside 128 json_schema copies"
