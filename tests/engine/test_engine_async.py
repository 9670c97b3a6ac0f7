"""Asynchronous scheduling (launch step N+1 before taking in step N's tokens) against the synchronous engine.

Both must produce the same outputs request by request: the in-flight token of a sequence is read on the device by
the next step, a sequence that stops computes one dropped token, and preemption, prefix hits, forks for
``num_return_sequences``, EOS, ``min_new_tokens``, repetition penalty (which needs the real tokens), seeded
sampling and aborts all see the same tokens. Checked here on the CPU, where the code path is the same.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged.engine._sequence import PLACEHOLDER


def _configs(n: int) -> list[GenerationConfig]:
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))
        elif kind == 1:  # stops early on some common tokens
            out.append(GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=list(range(3, 60))))
        elif kind == 2:
            out.append(GenerationConfig(max_new_tokens=9, min_new_tokens=6, do_sample=False,
                                        eos_token_id=list(range(3, 80))))
        elif kind == 3:
            out.append(GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
                                        eos_token_id=None))
        elif kind == 4:
            out.append(GenerationConfig(max_new_tokens=11, do_sample=True, temperature=0.8, top_k=20, seed=7 + i,
                                        eos_token_id=None, num_return_sequences=2))
        else:
            out.append(GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None))
    return out


def _run(async_scheduling: bool, num_blocks: int, abort_at: int | None = None):
    _, paged = models("llama_gqa")
    engine = hf_paged.Engine(paged, num_blocks=num_blocks, block_size=4, max_batch_tokens=48, max_num_seqs=8,
                             async_scheduling=async_scheduling)
    prefix = random_prompts(1, 9, 9, seed=11)[0]
    prompts = random_prompts(18, 1, 30, seed=3, prefixes=[prefix, []])
    pending = list(zip(prompts, _configs(len(prompts))))
    outs, streamed, ids, step = {}, {}, [], 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            ids.append(engine.add_request(*pending.pop(0)))
        for delta in engine.step_with_deltas()[1]:
            assert PLACEHOLDER not in delta.token_ids
            streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
        engine.scheduler.check_invariants()
        if abort_at is not None and step == abort_at:
            engine.abort(ids[4])
    return engine, streamed


@pytest.mark.parametrize("num_blocks", [400, 22])  # 22: preempts
def test_async_scheduling_gives_the_outputs_of_the_synchronous_engine(num_blocks):
    sync_engine, sync_tokens = _run(False, num_blocks)
    async_engine, async_tokens = _run(True, num_blocks)
    assert async_tokens == sync_tokens
    assert len(sync_tokens) == 18 + 3  # every request and the copies of num_return_sequences
    stats = async_engine.stats()
    assert stats["used_blocks"] == 0 and not async_engine.has_unfinished()
    assert stats["generated_tokens"] == sync_engine.stats()["generated_tokens"]
    if num_blocks == 22:
        assert stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_generate_and_abort_under_async_scheduling():
    _, paged = models("llama_gqa")
    prompts = random_prompts(6, 3, 20, seed=9)
    config = GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=None)
    ref = hf_paged.Engine(paged, num_blocks=200, block_size=4, async_scheduling=False).generate(prompts, config)
    engine = hf_paged.Engine(paged, num_blocks=200, block_size=4, async_scheduling=True)
    got = engine.generate(prompts, config)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    rid = engine.add_request(prompts[0], config)
    engine.step()
    engine.step()  # the request's first token is in flight now
    engine.abort(rid)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    assert out.finish_reason == "abort" and PLACEHOLDER not in out.token_ids
    assert out.token_ids == ref[0].token_ids[: len(out.token_ids)]
    assert engine.stats()["used_blocks"] == 0
