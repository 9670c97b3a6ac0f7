"""Weight updates: KV computed with old weights is never read again. After the model's parameters change in place (an
optimizer step, ``load_state_dict``, ``param.copy_``), a reused engine (or ``generate_batch``'s kept one) gives a
fresh engine's tokens: the prefix cache is forgotten and running requests are computed afresh. Other changes (a
write through ``param.data``) take ``reset_prefix_cache()``.

Each test builds its own tiny model (the shared ones of ``engine_helpers`` must keep their weights).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from engine_helpers import random_prompts
from tiny_models import make_models

ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
CONFIG = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
SHARED = random_prompts(1, 12, 12, seed=40)[0]  # a prefix of three full blocks, cached by the first call
PROMPTS = random_prompts(4, 2, 6, seed=41, prefixes=[SHARED])


def fresh_model(seed: int = 7) -> torch.nn.Module:
    return make_models("llama_gqa", seed=seed)[1]


def engine_for(model, async_scheduling: bool) -> hf_paged.Engine:
    return hf_paged.Engine(model, num_blocks=128, block_size=4, max_num_seqs=4, async_scheduling=async_scheduling)


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def load_other_weights(model):
    model.load_state_dict(fresh_model(seed=8).state_dict())


def optimizer_step(model):
    model.train()
    ids = torch.tensor([SHARED])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.zero_grad(set_to_none=True)
    model.eval()


def copy_in_place(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p * 1.5)


@pytest.mark.parametrize("update, async_scheduling", [(load_other_weights, False), (optimizer_step, False),
                                                       (copy_in_place, False), (load_other_weights, True)],
                         ids=["load_state_dict", "optimizer_step", "copy_", "load_state_dict-async"])
def test_a_reused_engine_gives_a_fresh_engines_tokens_after_an_in_place_update(update, async_scheduling):
    model = fresh_model()
    engine = engine_for(model, async_scheduling)
    before = tokens(engine.generate(PROMPTS, CONFIG))
    assert engine.stats()["cached_blocks"] >= 3 and engine.stats()["kv_resets"] == 0  # (no change: nothing forgotten)
    update(model)
    after = tokens(engine.generate(PROMPTS, CONFIG))
    assert after == tokens(engine_for(model, async_scheduling).generate(PROMPTS, CONFIG))
    assert after != before and engine.stats()["kv_resets"] == 1
    assert engine.stats()["used_blocks"] == 0


def test_without_the_check_the_stale_prefix_would_change_the_tokens():
    """The test above is sharp: with the version check switched off, the reused engine serves old KV."""
    model = fresh_model()
    engine = engine_for(model, False)
    engine.generate(PROMPTS, CONFIG)
    engine._weights, engine._weights_version = [], 0  # (nothing watched)
    load_other_weights(model)
    stale = tokens(engine.generate(PROMPTS, CONFIG))
    assert stale != tokens(engine_for(model, False).generate(PROMPTS, CONFIG))
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


@ASYNC
def test_requests_running_across_an_update_continue_as_a_fresh_engine_would(async_scheduling):
    """Tokens sampled before the update stay; every later one is what the new weights give after them."""
    model = fresh_model()
    engine = engine_for(model, async_scheduling)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None)
    ids = engine.add_requests(PROMPTS, config)
    for _ in range(4):
        engine.step()
    seen = {rid: engine.requests.open[rid].num_generated for rid in ids}  # (an in-flight token counts: it was sampled)
    load_other_weights(model)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step()})
    oracle = engine_for(model, False)
    for rid, prompt in zip(ids, PROMPTS):
        m = seen[rid]
        assert 0 < m < 10
        rest = oracle.generate([prompt + done[rid][:m]], GenerationConfig(max_new_tokens=10 - m, do_sample=False,
                                                                           eos_token_id=None))[0].token_ids
        assert done[rid][m:] == rest, rid
    assert engine.stats()["used_blocks"] == 0 and engine.stats()["kv_resets"] == 1


def test_reset_prefix_cache_covers_writes_the_version_counters_miss():
    model = fresh_model()
    engine = engine_for(model, False)
    engine.generate(PROMPTS, CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 1.5)  # (through .data: no version counter moves)
    engine.reset_prefix_cache()
    assert engine.stats()["cached_blocks"] == 0 and engine.stats()["kv_resets"] == 1
    assert tokens(engine.generate(PROMPTS, CONFIG)) == tokens(engine_for(model, False).generate(PROMPTS, CONFIG))


def test_generate_batch_kept_engine_follows_weight_updates():
    model = fresh_model()

    def run(**kwargs):
        results = hf_paged.generate_batch(model, PROMPTS, CONFIG, persistent_manager=True, **kwargs)
        return [r.generated_tokens for r in results.values()]

    run()
    load_other_weights(model)
    assert run() == tokens(engine_for(model, False).generate(PROMPTS, CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(0.5)
    assert run(reset_prefix_cache=True) == tokens(engine_for(model, False).generate(PROMPTS, CONFIG))
    with pytest.raises(ValueError, match="reset_prefix_cache"):
        hf_paged.generate_batch(model, PROMPTS, CONFIG, reset_prefix_cache="yes")
