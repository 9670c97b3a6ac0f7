"""Identical prompts of one ``generate_batch`` call (an RL trainer sends each prompt once per completion it wants)
share one prefill: they run as one request with a copy per prompt, whose prompt is computed once (each copy then
recomputes only the last prompt token, into its own block), and the results come back under the ids and in the order
of the prompts as given. Sampled copies draw apart; a seed makes a call reproducible, and calls without one differ."""

from __future__ import annotations

from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts

ARCH = "llama_gqa"
NEW = 4


def fed_tokens(model, run) -> tuple[object, int]:
    """``run()``'s result and how many tokens the model's forward computed meanwhile."""
    seen = []
    hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        kwargs["input_ids"].shape[-1]), with_kwargs=True)
    try:
        return run(), sum(seen)
    finally:
        hook.remove()


def test_identical_prompts_are_prefilled_once_and_come_back_in_order():
    model = models(ARCH)[1]
    same, other = random_prompts(2, 21, 21, seed=97)
    prompts = [same, other, same, same, same]  # k = 4 identical prompts, one other between them
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    results, fed = fed_tokens(model, lambda: hf_paged.generate_batch(model, prompts, config))
    assert list(results) == [f"req_{i}" for i in range(5)]
    assert [r.request_id for r in results.values()] == list(results)
    expected = hf_greedy(ARCH, [same, other], NEW)
    assert [r.generated_tokens for r in results.values()] == [expected[i] for i in (0, 1, 0, 0, 0)]
    assert all(r.prompt_ids == p for r, p in zip(results.values(), prompts))
    decode = len(prompts) * (NEW - 1)
    assert fed - decode == len(same) + 3 + len(other)  # one prefill of `same`, plus its last token per other copy
    _, separate = fed_tokens(model, lambda: [hf_paged.generate_batch(model, [p], config) for p in prompts])
    assert separate - decode == 4 * len(same) + len(other)  # (what the four would cost one by one)


def test_copies_of_identical_prompts_keep_each_prompts_ids_and_sampled_ones_draw_apart():
    model = models(ARCH)[1]
    prompt = random_prompts(1, 9, 9, seed=98)[0]
    config = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=1.5, top_k=0, top_p=1.0,
                              eos_token_id=None)
    config.num_return_sequences = 2
    seeded = ContinuousBatchingConfig(seed=11)
    first = hf_paged.generate_batch(model, [prompt] * 3, config, seeded)
    assert list(first) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1", "req_2__child#0", "req_2"]
    tokens = [tuple(r.generated_tokens) for r in first.values()]
    assert len(set(tokens)) > 1  # six draws, not one draw six times
    again = hf_paged.generate_batch(model, [prompt] * 3, config, seeded)
    assert [tuple(r.generated_tokens) for r in again.values()] == tokens  # a seed: the same call, the same draws
    unseeded = [[tuple(r.generated_tokens) for r in hf_paged.generate_batch(model, [prompt] * 3, config).values()]
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # no seed: each call draws afresh
    assert len(unseeded[0]) == 6


def test_without_max_new_tokens_each_request_runs_to_the_position_limit_whatever_its_length():
    """transformers' "no limit": each request gets the room its own prompt leaves (512 positions on the tiny model),
    identical prompts sharing one request included, and ends there with its own tokens."""
    model = models(ARCH)[1]
    short, long = random_prompts(2, 505, 505, seed=99)
    long = long + [7, 8]  # (507 tokens: 5 positions left, against 7 for the short one)
    prompts = [short, long, long, short]
    config = GenerationConfig(do_sample=False, eos_token_id=None)
    results = hf_paged.generate_batch(model, prompts, config)
    assert list(results) == ["req_0", "req_1", "req_2", "req_3"]
    assert [len(r.generated_tokens) for r in results.values()] == [512 - len(p) for p in prompts]
    assert [r.generated_tokens for r in results.values()] == [
        hf_greedy(ARCH, [p], 512 - len(p))[0] for p in prompts]
