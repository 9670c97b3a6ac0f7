"""Greedy tokens on a real model equal eager attention's, prompt by prompt: ``model.generate`` on a
``PagedAttentionCache`` (a left-padded batch of very different prompt lengths, and beam search), ``generate_batch``,
and the ``Engine`` under preemption; ``hf-paged generate`` answers the README's question with a sentence about Paris."""

from __future__ import annotations

import pytest
import torch
from real_chats import CHATS, NEW_TOKENS, chat_ids
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli import main

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    return {name: chat_ids(tokenizer, messages) for name, messages in CHATS.items()}


def left_padded(prompts: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return dict(input_ids=ids, attention_mask=mask)


def paged_cache(model, num_blocks: int = 256) -> hf_paged.PagedAttentionCache:
    return hf_paged.PagedAttentionCache(model.config, num_blocks=num_blocks, block_size=16, device="cpu",
                                        dtype=model.dtype)


def test_the_prompts_differ_a_lot_in_length(prompts):
    lengths = sorted(map(len, prompts.values()))
    assert lengths[0] < 40 and lengths[-1] > 5 * lengths[0]


def test_cli_generate_answers_the_capital_of_france_with_paris(smollm2_dir, capsys):
    # No --model: the default, SmolLM2 (the fixture made sure it is here); the prompt goes through its chat template.
    assert main(["generate", "What is the capital of France?", "--no-progress", "--device", "cpu"]) == 0
    prompt, answer, blank = capsys.readouterr().out.splitlines()[:3]
    assert prompt == "> What is the capital of France?" and "Paris" in answer, answer
    assert blank == "", blank  # no note under the answer: the model's end of turn ends it


def test_generate_on_a_paged_cache_equals_eager_on_a_padded_batch(paged, eager, prompts):
    model, tokenizer = paged
    batch = left_padded([prompts[name] for name in ("hi", "handbook", "name")], tokenizer.pad_token_id)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        want = eager.generate(**batch, **greedy)
        got = model.generate(**hf_paged.with_cache(model, paged_cache(model), **batch), **greedy)
    assert torch.equal(got, want)


def test_beam_search_on_a_paged_cache_equals_eager(paged, eager, prompts):
    model, tokenizer = paged
    batch = left_padded([prompts["capital"], prompts["name"]], tokenizer.pad_token_id)
    beams = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False, early_stopping=True)
    with torch.no_grad():
        want = eager.generate(**batch, **beams)
        got = model.generate(**hf_paged.with_cache(model, paged_cache(model), **batch), **beams)
    assert torch.equal(got, want)


def test_generate_batch_equals_eager_prompt_by_prompt(paged, oracle, prompts):
    model, tokenizer = paged
    inputs = list(prompts.values())
    # generate_batch reads the config it is given as transformers' does: EOS named here (generate takes the model's)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    results = hf_paged.generate_batch(model, inputs, config)
    outputs = sorted(results.values(), key=lambda o: int(o.request_id.split("_")[1]))
    for prompt, out in zip(inputs, outputs, strict=True):
        assert out.generated_tokens == oracle.greedy(prompt)


def test_engine_under_preemption_equals_eager_prompt_by_prompt(paged, oracle, prompts):
    model, tokenizer = paged
    inputs = list(prompts.values())
    # A pool for the longest prompt at full length and a little more: the others must wait or be preempted.
    num_blocks = -(-(max(map(len, inputs)) + NEW_TOKENS) // 16) + 3
    engine = hf_paged.Engine(model, tokenizer=tokenizer, num_blocks=num_blocks, block_size=16, max_batch_tokens=256)
    outs = engine.generate(inputs, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["num_blocks"]
    for prompt, out in zip(inputs, outs, strict=True):
        assert out.token_ids == oracle.greedy(prompt)
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
