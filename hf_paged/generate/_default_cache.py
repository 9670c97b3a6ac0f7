"""``generate`` on an ``"hf_paged"`` model called without a cache: a :class:`PagedAttentionCache` sized for the call.

transformers' ``generate`` makes the cache itself when the caller passes none (``GenerationMixin.
_prepare_cache_for_generation``, a ``DynamicCache`` unless ``cache_implementation`` says otherwise). ``import hf_paged``
wraps that method once: where the model's attention implementation is ``"hf_paged"`` and transformers has just made
its plain ``DynamicCache``, the call gets a ``PagedAttentionCache`` instead (``paged_cache_for``: each layer's KV on
that layer's device, a tensor-parallel model's own KV heads) with the blocks this call can use: every row its
``max_length`` tokens, plus one block for a row's copy of a shared block (beam search), at most what fits in 0.8 of
the free memory (the pool is made up front; an ``OutOfBlocksError`` then says when a call needs more). So callers
that never name a cache, such as lm-evaluation-harness's ``hf`` model, generate on paged memory. Every other case
(another attention implementation, a cache passed in, ``cache_implementation`` set, ``use_cache=False``, a model or
dtype the paged cache refuses) is transformers' own.
"""

from __future__ import annotations

import functools
import logging

from transformers.cache_utils import DynamicCache

from hf_paged import _compat
from hf_paged.cache._config import CacheConfig
from hf_paged.cache._kv_pool import DEFAULT_MEMORY_BUDGET, blocks_for_budget
from hf_paged.generate._paged_cache import PagedAttentionCache, paged_cache_for
from hf_paged.hf._placement import layer_devices
from hf_paged.hf._register import ATTN_IMPLEMENTATION
from hf_paged.parallel._tensor_parallel import kv_layout

logger = logging.getLogger("hf_paged")

_MARK = "_hf_paged_default_cache"  # set on the wrapper: installed once per process
_CACHE_KEYS = ("cache", "past_key_values")  # generate's model_kwargs name for it, later and earlier 5.x releases


def paged_default(model, generation_config, batch_size: int, max_cache_length: int) -> PagedAttentionCache:
    """The cache for a ``generate`` call of ``batch_size`` inputs on ``model`` whose sequences reach
    ``max_cache_length`` tokens."""
    rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    per_row = -(-max(max_cache_length, 1) // CacheConfig.block_size) + 1
    # at most what fits in the share of free memory a pool may take: the pool is made up front, where a DynamicCache
    # grows as it goes (not the automatic budget's CPU cap, which sizes the engine's long-lived pool)
    fits = blocks_for_budget(kv_layout(model), CacheConfig.block_size, model.dtype, layer_devices(model),
                             DEFAULT_MEMORY_BUDGET)
    return paged_cache_for(model, num_blocks=min(rows * per_row, max(fits, per_row)))


def install() -> None:
    """Wrap ``generate``'s cache maker (once, ``_compat.wrap_prepare_cache``)."""
    _compat.wrap_prepare_cache(_paged_unless_given)


def _paged_unless_given(prepare):
    if getattr(prepare, _MARK, False):
        return prepare

    @functools.wraps(prepare)
    def prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        given = [key for key in _CACHE_KEYS if model_kwargs.get(key) is not None]
        result = prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if (given or generation_config.cache_implementation not in (None, "dynamic")
                or _compat.attn_implementation(self.config) != ATTN_IMPLEMENTATION):
            return result
        for key in _CACHE_KEYS:
            if type(model_kwargs.get(key)) is DynamicCache:
                try:
                    model_kwargs[key] = paged_default(self, generation_config, batch_size, max_cache_length)
                except (ValueError, NotImplementedError) as exc:  # a model or dtype the paged cache refuses
                    logger.info("hf_paged: generate keeps transformers' DynamicCache: %s", exc)
        return result

    setattr(prepare_cache, _MARK, True)
    return prepare_cache
