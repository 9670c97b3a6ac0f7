"""hf_paged: vLLM-style paged attention for HuggingFace transformers.

``import hf_paged`` registers ``attn_implementation="hf_paged"``. The public API is what ``__all__`` lists:

- plain ``model.generate`` on paged memory: :class:`PagedAttentionCache` (settings: :class:`CacheConfig`),
  :func:`optimize_generate` / :func:`restore_generate`, :func:`with_cache`;
- continuous batching: :class:`Engine` (settings: :class:`EngineConfig`; outputs: :class:`RequestOutput`,
  :class:`TokenDelta`; per-request settings: :class:`SamplingParams`) and :func:`generate_batch`, the drop-in for
  transformers' ``model.generate_batch``;
- several GPUs: :func:`distributed_generate_batch` (data parallel) and :func:`paged_cache_for` (a cache for a model
  split by ``device_map`` or loaded with ``tp_plan``);
- :func:`available_backends`, :class:`OutOfBlocksError`, ``ATTN_IMPLEMENTATION``.

Everything else is internal: modules whose names begin with an underscore, and the packages' other names. The
command line is ``hf-paged`` (``hf_paged.cli``), the OpenAI-compatible server ``hf-paged serve``
(``hf_paged.server.create_app``).
"""

from __future__ import annotations

import warnings

from hf_paged._version import __version__
from hf_paged.attention._dispatch import available_backends
from hf_paged.cache import CacheConfig, OutOfBlocksError
from hf_paged.engine import (
    Engine,
    EngineConfig,
    RequestOutput,
    SamplingParams,
    TokenDelta,
    distributed_generate_batch,
    generate_batch,
)
from hf_paged.generate import PagedAttentionCache, optimize_generate, paged_cache_for, restore_generate
from hf_paged.generate._default_cache import install as _install_default_cache
from hf_paged.hf._register import ATTN_IMPLEMENTATION, register
from hf_paged.hf.compat import with_cache

register()
_install_default_cache()  # generate on an "hf_paged" model with no cache given: a PagedAttentionCache

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheConfig",
    "Engine",
    "EngineConfig",
    "OutOfBlocksError",
    "PagedAttentionCache",
    "RequestOutput",
    "SamplingParams",
    "TokenDelta",
    "available_backends",
    "distributed_generate_batch",
    "generate_batch",
    "optimize_generate",
    "paged_cache_for",
    "restore_generate",
    "with_cache",
]

_MOVED = {"BlockAllocator": "hf_paged.cache.BlockAllocator"}


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"hf_paged.{name} is internal and leaves the public API; import {_MOVED[name]} if you need it",
                      DeprecationWarning, stacklevel=2)
        from hf_paged import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")
