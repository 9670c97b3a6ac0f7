"""``generate_batch`` and the engine leave the caller's model on the attention it was loaded with: after them,
transformers' own ``model.generate_batch`` (which refuses a model on ``"hf_paged"``) and ``model.generate`` serve it
as before, with the tokens of a fresh eager model; a kept engine (``persistent_manager=True``) still serves later
calls; a model trained after the call trains as a fresh one; a model loaded with ``attn_implementation="hf_paged"``
stays on it and is served as before."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts
from hf_paged.engine import _generate_batch as module
from tiny_models import EOS, make_config

ARCH = "llama_gqa"


def _config() -> GenerationConfig:
    """Greedy, 6 tokens, the tiny model's EOS (as ``hf_greedy``'s); a new one each call (transformers' generate_batch
    writes into the one it is given)."""
    return GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=EOS)


# on the CPU transformers would size its cache from the RAM and warm up over its whole step budget: a small one
THEIR_CB = dict(num_blocks=16, max_batch_tokens=64)


def _loaded(implementation: str) -> torch.nn.Module:
    """A fresh copy of the suite's tiny model (eager's weights), loaded with ``implementation``."""
    model = AutoModelForCausalLM.from_config(make_config(ARCH), attn_implementation=implementation).eval()
    model.load_state_dict(models(ARCH)[0].state_dict())
    assert model.config._attn_implementation == implementation
    return model


def _ours(model, prompts, **kwargs) -> list[list[int]]:
    return [o.generated_tokens for o in hf_paged.generate_batch(model, prompts, _config(), **kwargs).values()]


def _theirs(model, prompts) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=_config(), progress_bar=False,
                               continuous_batching_config=ContinuousBatchingConfig(**THEIR_CB))
    assert all(o.error is None for o in out.values())
    return [o.generated_tokens for o in out.values()]


def _generate(model, prompts) -> list[list[int]]:
    """``model.generate``, one prompt at a time."""
    tokens = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_config())
        tokens.append(out[0, len(p):].tolist())
    return tokens


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_own_paths_serve_the_model_after_generate_batch(implementation):
    model = _loaded(implementation)
    prompts = random_prompts(3, 4, 14, seed=71)
    expected = hf_greedy(ARCH, prompts, 6)  # a fresh eager model's generate
    assert _ours(model, prompts) == expected
    assert model.config._attn_implementation == implementation
    assert _theirs(model, prompts) == expected
    assert model.config._attn_implementation == implementation
    assert _generate(model, prompts) == expected
    assert model.config._attn_implementation == implementation


def test_a_kept_engine_serves_call_after_call_and_the_model_is_the_callers_between_them():
    model = _loaded("eager")
    first, second = random_prompts(3, 4, 14, seed=72), random_prompts(2, 4, 10, seed=73)
    assert _ours(model, first, persistent_manager=True) == hf_greedy(ARCH, first, 6)
    kept = model.__dict__[module._KEPT][1]
    assert model.config._attn_implementation == "eager"
    assert _theirs(model, second) == _generate(model, second) == hf_greedy(ARCH, second, 6)
    assert _ours(model, second, persistent_manager=True) == hf_greedy(ARCH, second, 6)
    assert model.__dict__[module._KEPT][1] is kept and model.config._attn_implementation == "eager"
    assert _ours(model, first) == hf_greedy(ARCH, first, 6)  # (lets the kept engine go)
    assert module._KEPT not in model.__dict__ and model.config._attn_implementation == "eager"


def test_a_call_that_fails_puts_the_attention_back_too(monkeypatch):
    model = _loaded("sdpa")

    def broken_step(self):
        raise RuntimeError("a step failed")

    monkeypatch.setattr(hf_paged.Engine, "step", broken_step)
    with pytest.raises(RuntimeError, match="a step failed"):
        hf_paged.generate_batch(model, random_prompts(2, 4, 8, seed=74), _config())
    assert model.config._attn_implementation == "sdpa"


def test_an_engine_switches_the_model_while_open_and_back_when_closed():
    model = _loaded("eager")
    prompts = random_prompts(3, 4, 14, seed=75)
    with hf_paged.Engine(model, max_num_seqs=4) as engine:
        assert model.config._attn_implementation == "hf_paged"
        assert [o.token_ids for o in engine.generate(prompts, _config())] == hf_greedy(ARCH, prompts, 6)
    assert model.config._attn_implementation == "eager"
    assert _theirs(model, prompts) == _generate(model, prompts) == hf_greedy(ARCH, prompts, 6)


def test_a_model_loaded_with_the_paged_attention_stays_on_it_and_is_served():
    model = _loaded("hf_paged")
    prompts = random_prompts(3, 4, 14, seed=76)
    expected = hf_greedy(ARCH, prompts, 6)
    assert _ours(model, prompts) == expected and _ours(model, prompts, persistent_manager=True) == expected
    assert model.config._attn_implementation == "hf_paged"
    with hf_paged.Engine(model, max_num_seqs=4) as engine:
        assert [o.token_ids for o in engine.generate(prompts, _config())] == expected
    assert model.config._attn_implementation == "hf_paged"
    # its own generate with a paged cache, as before
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=32)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_paged.with_cache(model, cache),
                             generation_config=_config())
    assert out[0, len(prompts[0]):].tolist() == expected[0]


def test_training_after_generate_batch_runs_the_callers_attention_with_its_gradients():
    """A trainer's pattern: generate with a kept engine from a model in training mode, then train it. The forward
    and backward after the call are a fresh model's: its own attention with gradients, its modules in training
    mode, nothing of the engine's left in the way; and transformers' own paths serve it after a dtype change."""
    model, fresh = _loaded("sdpa"), _loaded("sdpa")
    prompts = random_prompts(3, 4, 14, seed=77)
    model.train()
    assert _ours(model, prompts, persistent_manager=True) == hf_greedy(ARCH, prompts, 6)
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([prompts[0] + prompts[1]])
    losses = []
    for m in (model, fresh.train()):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    for ours, theirs in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    model.eval().to(torch.bfloat16)
    assert _ours(model, prompts, persistent_manager=True) == _generate(model, prompts) == _theirs(model, prompts)
