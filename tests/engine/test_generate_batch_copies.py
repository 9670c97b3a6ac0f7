"""Copies of a greedy request (``num_return_sequences`` set on a ``GenerationConfig`` with ``do_sample=False``, which
transformers' own config check refuses for ``model.generate``) are served as transformers' ``model.generate_batch``
serves them (5.25): identical copies, under the same request ids and in the same order, checked against its own
output on the same tiny model (an older transformers returns one output per request; hf_paged serves the copies on
every release)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts
from tiny_models import EOS

ARCH = "llama_gqa"


def _greedy_copies(copies: int, max_new_tokens: int) -> GenerationConfig:
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS)
    config.num_return_sequences = copies  # set on the object: the constructor's check is not run
    return config


@pytest.mark.parametrize("copies,max_new_tokens,seed", [(2, 6, 81), (3, 9, 82)])
def test_greedy_copies_are_served_as_transformers_generate_batch_serves_them(copies, max_new_tokens, seed):
    eager, paged = models(ARCH)
    prompts = random_prompts(3, 4, 16, seed=seed)
    saved = eager.generation_config
    try:  # (transformers may write into the model's generation config)
        eager.generation_config = GenerationConfig.from_dict(saved.to_dict())
        theirs = eager.generate_batch(prompts, generation_config=_greedy_copies(copies, max_new_tokens),
                                      continuous_batching_config=ContinuousBatchingConfig(num_blocks=32,
                                                                                          max_batch_tokens=64),
                                      progress_bar=False)
    finally:
        eager.generation_config = saved
    ours = hf_paged.generate_batch(paged, prompts, _greedy_copies(copies, max_new_tokens))
    ids = [f"req_{i}__child#{k}" if k < copies - 1 else f"req_{i}" for i in range(len(prompts)) for k in range(copies)]
    assert list(ours) == ids
    expected = hf_greedy(ARCH, prompts, max_new_tokens)
    for rid, our in ours.items():
        assert our.generated_tokens == expected[int(rid.split("__")[0].removeprefix("req_"))]
    if len(theirs) == len(prompts):  # an older transformers (5.17) serves one output per request: nothing more to match
        assert list(theirs) == [f"req_{i}" for i in range(len(prompts))]
        return
    assert list(theirs) == ids
    for rid, their in theirs.items():
        our = ours[rid]
        assert type(our) is type(their) and {f.name for f in dataclasses.fields(our)} == {
            f.name for f in dataclasses.fields(their)}
        assert (our.request_id, our.prompt_ids, our.generated_tokens, our.status, our.error) == (
            their.request_id, their.prompt_ids, their.generated_tokens, their.status, their.error), rid
        assert our.generated_tokens == expected[int(rid.split("__")[0].removeprefix("req_"))]


def test_the_engine_serves_greedy_copies_too():
    prompts = random_prompts(2, 4, 12, seed=83)
    with hf_paged.Engine(models(ARCH)[1], max_num_seqs=8) as engine:
        outs = engine.generate(prompts, _greedy_copies(2, 5))
    expected = hf_greedy(ARCH, prompts, 5)
    assert [o.token_ids for o in outs] == [expected[0], expected[0], expected[1], expected[1]]
