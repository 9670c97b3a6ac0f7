"""A user's backend restriction that cannot serve the model is refused when the cache is built, with the reason and
what to allow, instead of failing (or failing every request) at the first forward; a cache built for another
model is refused with one line, not a raw index error."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.hf.compat import with_cache
from tiny_models import make_config, make_models


def test_a_restriction_that_cannot_serve_the_device_is_refused_up_front():
    config = make_config("llama_gqa")
    with pytest.raises(NotImplementedError, match=r"cuda: tensors are on cpu.*Allow more backends"):
        hf_paged.PagedAttentionCache(config, num_blocks=8, block_size=4, device="cpu", backend="cuda")
    with pytest.raises(NotImplementedError, match="flash"):
        hf_paged.PagedAttentionCache(config, num_blocks=8, block_size=4, device="cpu", backend="flash")
    _, paged = make_models("llama_gqa")
    with pytest.raises(NotImplementedError, match="no attention backend can serve"):
        hf_paged.Engine(paged, num_blocks=8, block_size=4, backend="cuda")


def test_a_restriction_that_can_serve_runs_as_before():
    _, paged = make_models("llama_gqa")
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=8, block_size=4, device="cpu", backend="cuda,torch")
    assert cache.stats()["backends"] == {}  # checked, not yet served
    engine = hf_paged.Engine(paged, num_blocks=32, block_size=4, backend="torch")
    out = engine.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None))
    assert len(out[0].token_ids) == 3 and engine.stats()["backends"]["decode"] == "torch"


def test_a_cache_built_for_another_model_is_refused_with_one_line():
    _, paged = make_models("llama_gqa")
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    other = make_config("qwen3")  # other head_dim
    fewer, more = make_config("llama_gqa"), make_config("llama_gqa")
    fewer.num_hidden_layers, more.num_hidden_layers = 1, 3  # the model has 2 layers
    for config in (other, fewer, more):
        cache = hf_paged.PagedAttentionCache(config, num_blocks=8, block_size=4)
        with pytest.raises(ValueError, match="this cache was built for another model"):
            paged(**with_cache(paged, cache, **batch))
