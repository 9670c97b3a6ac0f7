"""Weight updates: KV computed with old weights is never read again. After the model's parameters change in place (an
optimizer step, fused ones included, ``load_state_dict``, ``param.copy_``), a reused engine (or ``generate_batch``'s
kept one) gives a fresh engine's tokens: the prefix cache is forgotten and running requests are computed afresh.
``generate_batch``'s kept engine also follows writes through ``param.data``, replaced parameters and a dtype change;
an engine of one's own takes ``reset_prefix_cache()`` after a write through ``param.data``.

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


def fused_adamw_step(model):  # (fused kernels leave the version counters alone: the optimizer step hook raises them)
    _train_step(torch.optim.AdamW, lr=1e-2, fused=True)(model)


@pytest.mark.parametrize("update, async_scheduling", [(load_other_weights, False), (optimizer_step, False),
                                                       (fused_adamw_step, False), (copy_in_place, False),
                                                       (load_other_weights, True)],
                         ids=["load_state_dict", "optimizer_step", "fused_adamw", "copy_", "load_state_dict-async"])
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
    engine.weights.params, engine.weights._counted = [], 0  # (nothing watched)
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


def _train_step(optimizer_class, **kwargs):
    """An update by one optimizer step (the optimizer made once per model and kept, with its state)."""

    def update(model):
        if not hasattr(model, "_test_optimizer"):
            model._test_optimizer = optimizer_class(model.parameters(), lr=kwargs.pop("lr"), **kwargs)
        optimizer_step_with(model, model._test_optimizer)

    return update


def optimizer_step_with(model, optimizer):
    model.train()
    ids = torch.tensor([SHARED])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def write_through_data(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 1.5)  # (no version counter moves)


def replace_parameters(model):
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach() * 1.5))


def switch_dtype(model):
    model.to(torch.bfloat16 if model.dtype == torch.float32 else torch.float32)


@pytest.mark.parametrize("update", [_train_step(torch.optim.AdamW, lr=0.05, fused=True),
                                    _train_step(torch.optim.AdamW, lr=0.05, foreach=True),
                                    _train_step(torch.optim.SGD, lr=1.0), write_through_data, replace_parameters,
                                    switch_dtype],
                         ids=["adamw_fused", "adamw_foreach", "sgd", "param.data.copy_", "replaced", "to_dtype"])
def test_a_kept_engine_gives_eager_generates_tokens_after_every_update(update):
    """generate_batch's kept engine after each of three updates: greedy tokens equal the model's own eager
    ``generate`` on the updated weights (the model runs eager attention outside the call). The prompts share a
    prefix of three blocks that the call before cached, so stale KV would change the tokens."""
    model = make_models("llama_gqa", seed=7)[0]  # (eager attention: generate_batch switches it and back)
    model.generation_config.eos_token_id = None  # (generate would take it for CONFIG's None)
    batching = hf_paged.EngineConfig(num_blocks=128, block_size=4, max_num_seqs=4)
    hf_paged.generate_batch(model, PROMPTS, CONFIG, batching, persistent_manager=True)
    engine = model.__dict__["_hf_paged_engine"][1]
    outputs = []
    for _ in range(3):
        update(model)
        results = hf_paged.generate_batch(model, PROMPTS, CONFIG, batching, persistent_manager=True)
        got = [r.generated_tokens for r in results.values()]
        with torch.no_grad():
            want = [model.generate(torch.tensor([p]), generation_config=CONFIG)[0, len(p):].tolist() for p in PROMPTS]
        assert got == want
        outputs.append(got)
    engine_now = model.__dict__["_hf_paged_engine"][1]
    if update is switch_dtype:  # (bfloat16's rounding leaves these tokens alone; the old pool would fail them)
        assert engine_now is not engine and engine_now.runner.pool.dtype == torch.bfloat16
        return
    assert outputs[0] != outputs[1] or outputs[1] != outputs[2]  # (the updates changed the tokens)
    if update is replace_parameters:
        assert engine_now is not engine  # (a pool and graphs of the old parameters are not reused)
    else:
        assert engine_now is engine and engine.stats()["kv_resets"] == 3
