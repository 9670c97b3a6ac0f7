"""What ``PagedAttentionCache`` hands transformers: a per-layer view of the pool, and the query offset that carries
the cache to the ``"hf_paged"`` mask function."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from hf_paged.generate._paged_cache import PagedAttentionCache


class PlanOffset(int):
    """The query offset ``generate``'s mask code asks the cache for, carrying the cache to the mask function.

    It is an ``int`` (the number of columns seen), so any other reader gets the plain offset.
    """

    paged_cache: PagedAttentionCache

    def __new__(cls, value: int, cache: PagedAttentionCache):
        obj = super().__new__(cls, value)
        obj.paged_cache = cache
        return obj


class PagedLayer(CacheLayerMixin):
    """One layer's view of the pool, so transformers code that walks ``cache.layers`` finds real tensors."""

    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: PagedAttentionCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.keys, self.values = owner.pool.kv_caches[layer_idx]
        self.is_initialized = True

    @property
    def is_compileable(self) -> bool:
        return self.owner.is_compileable

    def lazy_initialization(self, key_states, value_states) -> None:
        return None  # the pool is allocated up front

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1
