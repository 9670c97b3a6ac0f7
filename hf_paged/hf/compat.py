"""Differences between transformers 5.x releases, kept in one place.

- The cache keyword of ``forward``/``generate``: ``past_key_values`` (5.17) became ``cache`` in later 5.x releases
  (the old name still works there, with a deprecation warning).
- ``Cache.update`` receives the layer's kwargs in later releases (``kwargs=...``); ``PagedAttentionCache.update``
  accepts and ignores extra arguments, so both call shapes work.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_cls: type) -> str:
    """The keyword under which the model class's ``forward`` (and ``generate``) takes a ``Cache`` object."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def cache_in(kwargs: dict):
    """The cache among a forward's (or a mask builder's) keyword arguments, under either release's name, or None."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def with_cache(model: torch.nn.Module, cache, **kwargs) -> dict:
    """``kwargs`` plus ``cache`` under the keyword with which this transformers release's ``model.generate`` takes
    a cache: ``past_key_values`` in transformers 5.17, ``cache`` in later 5.x releases (which also still take the old
    name). ``model.generate(**batch, **hf_paged.with_cache(model, cache), max_new_tokens=64)``.
    """
    return {**kwargs, _cache_keyword(type(model)): cache}
