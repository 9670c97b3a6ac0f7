"""Logprobs of the sampled tokens, raw or processed (``logprobs_mode``), through ``generate_batch``'s
``return_logprobs``: processed ones equal the log-softmax of the eager model's logits after transformers' own logits
processors (repetition penalty, temperature, top-k, top-p: the distribution each token was drawn from, renormalized)
within 1e-4 in float32; raw ones the log-softmax of its logits as they are. What an RL trainer compares its own
log-probabilities with."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import hf_paged
from engine_helpers import models, random_prompts

ARCH = "llama_gqa"


def batching(mode: str | None, seed: int = 5):
    settings = dict(return_logprobs=True, seed=seed, **({"logprobs_mode": mode} if mode else {}))
    return type("CBConfig", (), settings)()


def oracle(prompt: list[int], new: list[int], processors: LogitsProcessorList) -> list[float]:
    """The eager model's log-probability of each new token under the processed distribution it was drawn from."""
    eager, _ = models(ARCH)
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        logits = eager(ids).logits[0].float()
    out = []
    for i, token in enumerate(new):
        at = len(prompt) - 1 + i
        scores = processors(ids[:, : at + 1], logits[at : at + 1].clone())
        out.append(torch.log_softmax(scores, -1)[0, token].item())
    return out


SETTINGS = {  # id: (GenerationConfig settings, transformers' processors in generate's order)
    "temperature": (dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0),
                    [TemperatureLogitsWarper(0.7)]),
    "top_k": (dict(do_sample=True, temperature=0.7, top_k=6, top_p=1.0),
              [TemperatureLogitsWarper(0.7), TopKLogitsWarper(6)]),
    "top_p": (dict(do_sample=True, temperature=1.3, top_k=0, top_p=0.7),
              [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.7)]),
    "penalty_top_k_top_p": (dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=1.5),
                            [RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.9),
                             TopKLogitsWarper(20), TopPLogitsWarper(0.8)]),
    "greedy_penalty": (dict(do_sample=False, repetition_penalty=1.5), [RepetitionPenaltyLogitsProcessor(1.5)]),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_processed_logprobs_equal_the_eager_models_processed_distribution(name):
    settings, processors = SETTINGS[name]
    config = GenerationConfig(max_new_tokens=6, eos_token_id=None, **settings)
    prompts = random_prompts(3, 4, 12, seed=95)
    results = hf_paged.generate_batch(models(ARCH)[1], prompts, config, batching("processed_logprobs"))
    raw = hf_paged.generate_batch(models(ARCH)[1], prompts, config, batching(None))  # (the default: raw)
    for prompt, out, raw_out in zip(prompts, results.values(), raw.values()):
        assert len(out.logprobs) == len(out.generated_tokens) == 6
        want = oracle(prompt, out.generated_tokens, LogitsProcessorList(processors))
        assert out.logprobs == pytest.approx(want, abs=1e-4)
        assert raw_out.generated_tokens == out.generated_tokens  # (the mode changes no token)
        assert raw_out.logprobs == pytest.approx(oracle(prompt, out.generated_tokens, LogitsProcessorList()),
                                                 abs=1e-4)


def test_a_logprobs_mode_that_does_not_exist_is_refused_naming_it():
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw_logprobs' or 'processed_logprobs'"):
        hf_paged.generate_batch(models(ARCH)[1], [[5, 6, 7]], GenerationConfig(max_new_tokens=2),
                                batching("processed"))
    with pytest.raises(ValueError, match="logprobs_mode"):
        hf_paged.EngineConfig(logprobs_mode="raw")
