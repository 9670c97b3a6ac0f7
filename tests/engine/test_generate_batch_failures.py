"""``generate_batch`` never hands back an empty result for a request that failed: it generates in eval mode whatever
mode the model is in (a trainer generates between training steps, dropout on) and puts every module's mode back,
and a request that still fails makes the call raise, naming the request and why."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig
from transformers.generation.continuous_batching import RequestStatus

import hf_paged
from engine_helpers import hf_greedy, random_prompts
from tiny_models import make_models

ARCH = "llama_gqa"
CONFIG = GenerationConfig(max_new_tokens=5, do_sample=False)


def test_a_model_in_training_mode_with_dropout_generates_in_eval_mode_and_goes_back_to_its_modes():
    model = make_models(ARCH, attention_dropout=0.5)[1]  # (the weights of engine_helpers' models: the same seed)
    model.train()
    model.model.layers[0].mlp.eval()  # (a module the caller keeps in eval mode stays so)
    prompts = random_prompts(3, 4, 12, seed=90)
    results = hf_paged.generate_batch(model, prompts, CONFIG)
    assert [r.generated_tokens for r in results.values()] == hf_greedy(ARCH, prompts, 5)
    assert model.training and model.model.layers[1].self_attn.training and not model.model.layers[0].mlp.training


@pytest.mark.parametrize("prompt, batching, reason", [
    ([5] * 600, None, "position limit"),  # (past the tiny model's 512 positions)
    (list(range(3, 43)), type("CBConfig", (), dict(num_blocks=3, block_size=4))(), "num_blocks"),  # 12 slots
], ids=["position_limit", "pool"])
def test_a_request_that_fails_raises_with_its_reason(prompt, batching, reason):
    model = make_models(ARCH)[1]
    ok = random_prompts(1, 3, 6, seed=91)[0]
    with pytest.raises(hf_paged.GenerateBatchError, match=rf"1 of 2 requests failed: req_1: .*{reason}") as failure:
        hf_paged.generate_batch(model, [ok, prompt], CONFIG, batching)
    results = failure.value.results  # (the others' work is not lost)
    assert list(results) == ["req_0", "req_1"] and results["req_1"].status == RequestStatus.FAILED
    assert results["req_0"].generated_tokens == hf_greedy(ARCH, [ok], 5)[0] and results["req_0"].error is None
    assert reason in results["req_1"].error and results["req_1"].generated_tokens == []
    assert hf_paged.generate_batch(model, [ok], CONFIG, batching)["req_0"].generated_tokens == hf_greedy(
        ARCH, [ok], 5)[0]  # (the model serves the next call)
