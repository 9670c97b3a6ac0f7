"""Paged KV storage: the block allocator, the per-layer pool and the transformers ``Cache``."""

from hf_paged.cache.block_allocator import BlockAllocator, OutOfBlocksError
from hf_paged.cache.kv_pool import KVLayout, KVPool
from hf_paged.cache.paged_cache import PagedAttentionCache

__all__ = ["BlockAllocator", "KVLayout", "KVPool", "OutOfBlocksError", "PagedAttentionCache"]
