"""``generate`` on an ``"hf_paged"`` model with no cache given runs on a PagedAttentionCache of its own
(``hf_paged.generate._default_cache``) with eager's tokens; other models, a cache passed in, ``cache_implementation``
and ``use_cache=False`` keep transformers' own behaviour."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.generate import _default_cache
from tiny_models import EOS, PAD, left_padded_batch, make_models


@pytest.fixture
def made(monkeypatch):
    """The caches the wrapper made (each one's plan count)."""
    caches = []
    default = _default_cache.paged_default

    def recording(*args):
        cache = default(*args)
        caches.append(cache)
        return cache

    monkeypatch.setattr(_default_cache, "paged_default", recording)
    return caches


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2"])
@pytest.mark.parametrize("search", [dict(do_sample=False), dict(num_beams=3, num_return_sequences=2, do_sample=False)])
def test_generate_without_a_cache_runs_paged_with_eager_tokens(arch, search, made):
    eager, paged = make_models(arch, seed=7)
    batch = left_padded_batch([4, 13, 7], torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=7, pad_token_id=PAD, eos_token_id=EOS, **search)
    out = paged.generate(**batch, **kw, return_dict_in_generate=True)
    assert torch.equal(out.sequences, eager.generate(**batch, **kw))
    assert len(made) == 1 and isinstance(made[0], hf_paged.PagedAttentionCache)
    stats = made[0].stats()
    assert stats["blocks_used"] > 0 and "prefill" in stats["backends"]
    rows = 3 * (3 if "num_beams" in search else 1)
    assert made[0].num_blocks == rows * (-(-(13 + 7 - 1) // made[0].block_size) + 1)


def test_other_callers_keep_transformers_cache(made):
    eager, paged = make_models("llama_gqa", seed=8)
    batch = left_padded_batch([5, 9], torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, return_dict_in_generate=True)
    want = eager.generate(**batch, **kw)
    assert isinstance(want.past_key_values, DynamicCache) and not made  # another attention implementation
    assert paged.generate(**batch, **kw, use_cache=False).past_key_values is None
    static = paged.generate(**batch, **kw, cache_implementation="static")
    assert not isinstance(static.past_key_values, hf_paged.PagedAttentionCache)
    assert not made
    assert torch.equal(static.sequences, want.sequences)


def test_install_is_idempotent():
    from transformers import GenerationMixin

    wrapped = GenerationMixin._prepare_cache_for_generation
    assert getattr(wrapped, _default_cache._MARK)
    _default_cache.install()
    assert GenerationMixin._prepare_cache_for_generation is wrapped
