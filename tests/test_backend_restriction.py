"""A user's backend restriction that cannot serve the model is refused when the cache is built, with the reason and
what to allow, instead of failing (or failing every request) at the first forward."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
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
