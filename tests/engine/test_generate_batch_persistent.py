"""``generate_batch(..., persistent_manager=True)`` keeps its engine on the model for the next call, as transformers
keeps its manager, and gives the outputs a fresh engine gives."""

from __future__ import annotations

from transformers import GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged.engine._generate_batch import _KEPT


def _tokens(results):
    return {rid: out.generated_tokens for rid, out in results.items()}


def test_a_persistent_engine_is_reused_and_gives_fresh_engine_outputs():
    _, paged = models("llama_gqa")
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)
    first, second = random_prompts(4, 3, 20, seed=21), random_prompts(3, 3, 12, seed=22)
    fresh = [_tokens(hf_paged.generate_batch(paged, p, config)) for p in (first, second)]
    assert _KEPT not in paged.__dict__
    kept = _tokens(hf_paged.generate_batch(paged, first, config, persistent_manager=True))
    engine = paged.__dict__[_KEPT][1]
    again = _tokens(hf_paged.generate_batch(paged, second, config, persistent_manager=True))
    assert paged.__dict__[_KEPT][1] is engine  # the second workload fits the first pool: same engine
    assert [kept, again] == fresh
    assert engine.stats()["used_blocks"] == 0
    bigger = random_prompts(12, 40, 60, seed=23)  # does not fit the kept pool: a new engine replaces it
    big = _tokens(hf_paged.generate_batch(paged, bigger, config, persistent_manager=True))
    assert paged.__dict__[_KEPT][1] is not engine
    assert big == _tokens(hf_paged.generate_batch(paged, bigger, config))
    assert _KEPT not in paged.__dict__  # the call without persistent_manager let it go
