"""Drop-in fidelity with transformers' own ``model.generate_batch``: a table of configs runs through both on one tiny
model (CPU) and gives the same results, field by field; what transformers accepts and hf_paged does not apply is
refused with the field's name; every field of the installed transformers' configs is in ``engine/_batch_configs.py``'s
tables (a new release's new field fails here until it is placed)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_paged
from engine_helpers import models, random_prompts
from hf_paged import _compat
from hf_paged.engine import _batch_configs as tables

#: ContinuousBatchingConfig's fields: its block size is ``page_size`` from transformers 5.18 on, ``block_size`` before
_CB_FIELDS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}

ARCH = "llama_gqa"
PROMPTS = random_prompts(3, 4, 14, seed=41)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' continuous batching warns on every call without an EOS, and of the processors it drops."""
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level = cb_logger.level
    cb_logger.setLevel(logging.ERROR)
    yield
    cb_logger.setLevel(level)


def test_every_field_of_both_configs_has_a_meaning_here():
    generation = set(vars(GenerationConfig()))
    placed = (set(tables.GENERATION_READ) | set(tables.GENERATION_APPLIED_HERE) | set(tables.GENERATION_REFUSED)
              | tables.GENERATION_NO_EFFECT)
    assert generation - placed == set(), "GenerationConfig fields missing from engine/_batch_configs.py's tables"
    batching = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert batching - set(tables.BATCHING_READ) - tables.BATCHING_NO_EFFECT == set(), \
        "ContinuousBatchingConfig fields missing from engine/_batch_configs.py's tables"
    groups = [set(tables.GENERATION_READ), set(tables.GENERATION_APPLIED_HERE), set(tables.GENERATION_REFUSED),
              set(tables.GENERATION_NO_EFFECT)]
    assert sum(map(len, groups)) == len(set().union(*groups)), "a field in two tables"


def _theirs(config: GenerationConfig | None, cb: ContinuousBatchingConfig | None, **kwargs) -> dict:
    eager = models(ARCH)[0]
    saved = eager.generation_config
    eager.generation_config = GenerationConfig.from_dict(saved.to_dict())  # transformers may write -1 into it
    try:
        return eager.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=cb,
                                    progress_bar=False, **kwargs)
    finally:
        eager.generation_config = saved


def _ours(config: GenerationConfig | None, cb, **kwargs) -> dict:
    return hf_paged.generate_batch(models(ARCH)[1], PROMPTS, config, cb, **kwargs)


def _greedy_tokens() -> list[list[int]]:
    out = _ours(GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1), None)
    return [o.generated_tokens for o in out.values()]


def _cases():
    """(name, generation config, continuous-batching config, keywords): configs whose tokens are determined (greedy,
    or top-k 1), built lazily: some EOS ids are tokens the model emits."""
    emitted = _greedy_tokens()
    second, fourth = emitted[0][1], emitted[1][3]
    # on the CPU transformers would size its cache from the RAM, and its warm-up runs its step budget (35 s each
    # call on 5.17 with the automatic one)
    cb = lambda **kw: ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, **kw)
    return [
        ("unset EOS is no EOS", GenerationConfig(max_new_tokens=7), cb(), {}),
        ("-1 is no EOS", GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=-1), cb(), {}),
        ("an emitted EOS stops", GenerationConfig(max_new_tokens=8, eos_token_id=second), cb(), {}),
        ("an EOS list", GenerationConfig(max_new_tokens=8, eos_token_id=[-1, 150, fourth]), cb(), {}),
        ("top-k 1 sampling", GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, temperature=0.7),
         cb(seed=3), {}),
        ("copies", GenerationConfig(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2), cb(), {}),
        ("the keyword wins", GenerationConfig(max_new_tokens=50), cb(), {"max_new_tokens": 4}),
        ("the model's config", None, cb(), {"max_new_tokens": 6}),
        ("every batching setting",
         GenerationConfig(max_new_tokens=6, do_sample=False),
         ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=24, max_requests_per_batch=2, max_memory_percent=0.5,
                                  allow_block_sharing=False, return_logprobs=True, seed=1, use_cuda_graph=False,
                                  use_async_batching=False, scheduler_type="prefill_first", max_blocks_per_request=8,
                                  **({"page_size": 32} if "page_size" in _CB_FIELDS else {"block_size": 32})),
         {}),
        ("timestamps", GenerationConfig(max_new_tokens=5, do_sample=False), cb(), {"record_timestamps": True}),
        ("a kept manager", GenerationConfig(max_new_tokens=5, do_sample=False), cb(), {"persistent_manager": True}),
    ]


@pytest.mark.slow
def test_a_table_of_configs_gives_transformers_results():
    fields = {f.name for f in dataclasses.fields(_compat.GenerationOutput)}
    for name, config, cb, kwargs in _cases():
        theirs = _theirs(config, cb, **kwargs)
        ours = _ours(config, cb, **kwargs)
        if kwargs.get("persistent_manager"):
            models(ARCH)[0].destroy_cached_continuous_batching_manager()
            models(ARCH)[1].__dict__.pop("_hf_paged_engine", None)
        # transformers 5.17 returns the prompts' own results only (its copies are lost): ours keep them, in the
        # order newer releases give
        assert set(theirs) <= set(ours) and [k for k in ours if k in theirs] == list(theirs), name
        for rid, their in theirs.items():
            our = ours[rid]
            assert {f.name for f in dataclasses.fields(our)} == fields and type(our) is type(their), name
            assert (our.request_id, our.prompt_ids, our.generated_tokens, our.status, our.error) == (
                their.request_id, their.prompt_ids, their.generated_tokens, their.status, their.error), (name, rid)
            assert len(our.logprobs) == len(their.logprobs), name
            torch.testing.assert_close(torch.tensor(our.logprobs), torch.tensor(their.logprobs), atol=1e-4, rtol=0)
            assert (our.timestamps is None) == (their.timestamps is None), name
            if our.timestamps is not None:
                assert len(our.timestamps) == len(our.generated_tokens) and our.timestamps == sorted(our.timestamps)
            assert our.created_time <= our.lifespan[0] <= our.lifespan[1], name


def test_settings_transformers_drops_are_applied_as_generate_applies_them():
    """transformers' generate_batch drops the min-length and repetition-penalty processors (a warning); hf_paged
    applies them, as ``model.generate`` does: its tokens are the oracle."""
    eager = models(ARCH)[0]
    stop = _greedy_tokens()[0][1]
    for config in (GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=stop, min_new_tokens=4),
                   GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=1.5, eos_token_id=-1)):
        ours = _ours(config, None)
        for prompt, out in zip(PROMPTS, ours.values()):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                ref = eager.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert out.generated_tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("setting, value", [("num_beams", 2), ("typical_p", 0.5), ("no_repeat_ngram_size", 2),
                                            ("stop_strings", ["x"]), ("bad_words_ids", [[5]])])
def test_what_hf_paged_does_not_apply_is_refused_naming_the_field(setting, value):
    config = GenerationConfig(max_new_tokens=3, do_sample=False, **{setting: value})
    with pytest.raises(ValueError, match=setting):
        _ours(config, None)


def test_transformers_num_blocks_keep_their_capacity_in_hf_paged_blocks():
    """``num_blocks`` counts blocks of ``page_size`` (``block_size`` before 5.18) tokens, 256 by default: the pool
    holds the same tokens in hf_paged's 16-token blocks."""
    assert tables.engine_config(ContinuousBatchingConfig(num_blocks=2)).num_blocks == 2 * 256 // 16
    assert tables.engine_config(type("C", (), {"num_blocks": 5, "block_size": 8})()).num_blocks == 5
    assert tables.engine_config(type("C", (), {"num_blocks": 3, "page_size": 64})()).num_blocks == 3
    assert tables.engine_config(type("C", (), {"num_blocks": 3})()).num_blocks == 3 * 256 // 16
    with pytest.raises(ValueError, match="max_requests_per_batch"):
        tables.engine_config(ContinuousBatchingConfig(max_requests_per_batch=0))
    assert tables.engine_config(ContinuousBatchingConfig(use_cuda_graph=(True, False))).cuda_graphs is False


def test_eos_token_id_reads_as_transformers_generate_batch_reads_it():
    """None and -1 are no EOS, a negative entry of a list is dropped; a non-integer is refused naming the field."""
    def eos(value):
        gc = GenerationConfig(max_new_tokens=1, eos_token_id=value)
        return tables.generation_config(gc, None, None, 64).eos_token_id

    assert eos(None) == [] and eos(-1) == [] and eos(torch.tensor([2, -1, 7])) == [2, 7] and eos(3) == [3]
    with pytest.raises(ValueError, match="eos_token_id"):
        eos([2, 1.5])
