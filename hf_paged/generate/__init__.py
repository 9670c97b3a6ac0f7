"""Plain ``model.generate`` on paged memory: the ``PagedAttentionCache`` adapter and ``optimize_generate``."""

from hf_paged.generate._optimize import optimize_generate, restore_generate
from hf_paged.generate._paged_cache import PagedAttentionCache, paged_cache_for

__all__ = ["PagedAttentionCache", "optimize_generate", "paged_cache_for", "restore_generate"]
