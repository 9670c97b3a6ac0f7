"""hf_paged: vLLM-style paged attention for HuggingFace transformers.

``import hf_paged`` registers ``attn_implementation="hf_paged"`` with transformers. The public API is what
``__all__`` lists:

- plain ``model.generate`` on paged memory: :class:`PagedAttentionCache` (settings: :class:`CacheConfig`),
  :func:`optimize_generate` / :func:`restore_generate`, :func:`with_cache`;
- continuous batching: :class:`Engine` (settings: :class:`EngineConfig`; outputs: :class:`RequestOutput`,
  :class:`TokenDelta`; per-request settings: :class:`SamplingParams`) and :func:`generate_batch`, the drop-in for
  transformers' ``model.generate_batch`` (:class:`GenerateBatchError` when a request fails);
- several GPUs: :func:`distributed_generate_batch` (data parallel) and :func:`paged_cache_for` (a cache for a model
  split by ``device_map`` or loaded with ``tp_plan``);
- :func:`available_backends`, :class:`OutOfBlocksError`, ``ATTN_IMPLEMENTATION``.

Everything else is internal: modules whose names begin with an underscore, and the packages' other names. The
command line is ``hf-paged`` (``hf_paged.cli``), the OpenAI-compatible server ``hf-paged serve``
(``hf_paged.server.create_app``).

``import hf_paged`` itself imports neither torch nor transformers: each public name is imported from its module on
first use (``_LAZY``, through ``hf_paged/_lazy.py``: for start-up time, not to dodge an import cycle), and the
registration runs once transformers' model code is imported (``hf_paged/hf/_autoregister.py``), at once where it
already is. So ``from_pretrained(..., attn_implementation="hf_paged")`` works after ``import hf_paged`` in either
order, and ``hf-paged --help`` answers before torch is loaded.
"""

from __future__ import annotations

from hf_paged._lazy import lazy_exports
from hf_paged._version import __version__
from hf_paged.hf._autoregister import when_transformers_models_load

_LAZY = {
    "ATTN_IMPLEMENTATION": "hf_paged.hf._register",
    "CacheConfig": "hf_paged.cache._config",
    "Engine": "hf_paged.engine._engine",
    "EngineConfig": "hf_paged.engine._config",
    "GenerateBatchError": "hf_paged.engine._generate_batch",
    "OutOfBlocksError": "hf_paged.cache._block_allocator",
    "PagedAttentionCache": "hf_paged.generate._paged_cache",
    "RequestOutput": "hf_paged.engine._request_output",
    "SamplingParams": "hf_paged.engine._sampling_params",
    "TokenDelta": "hf_paged.engine._request_output",
    "available_backends": "hf_paged.attention._dispatch",
    "distributed_generate_batch": "hf_paged.engine._data_parallel",
    "generate_batch": "hf_paged.engine._generate_batch",
    "optimize_generate": "hf_paged.generate._optimize",
    "paged_cache_for": "hf_paged.generate._paged_cache",
    "restore_generate": "hf_paged.generate._optimize",
    "with_cache": "hf_paged.hf.compat",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def _register_with_transformers() -> None:
    """``attn_implementation="hf_paged"`` and its mask function, and ``generate``'s default paged cache for such a
    model (``generate/_default_cache.py``). torch and transformers are imported here, when this runs: on the host
    whatever device context the code that imported transformers holds (a meta one, while it builds a model), since
    hf_paged's modules make a few tensors of their own as they load."""
    import torch

    with torch.device("cpu"):
        from hf_paged.generate._default_cache import install as install_default_cache
        from hf_paged.hf._register import register

    register()
    install_default_cache()


when_transformers_models_load(_register_with_transformers)
