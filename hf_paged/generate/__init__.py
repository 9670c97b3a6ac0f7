"""Plain ``model.generate`` on paged memory: the ``PagedAttentionCache`` adapter and ``optimize_generate``.

The names below are imported on first use (``hf_paged/_lazy.py``): the registration's default cache
(``_default_cache.py``) imports the cache's module alone, without ``optimize_generate``'s compile machinery.
"""

from hf_paged._lazy import lazy_exports

_LAZY = {
    "PagedAttentionCache": "hf_paged.generate._paged_cache",
    "optimize_generate": "hf_paged.generate._optimize",
    "paged_cache_for": "hf_paged.generate._paged_cache",
    "restore_generate": "hf_paged.generate._optimize",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
