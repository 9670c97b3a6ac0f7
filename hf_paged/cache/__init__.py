"""The KV pool and its bookkeeping: the block allocator, the per-layer K/V tensors, and the engine's block manager."""

from hf_paged.cache._block_allocator import BlockAllocator, OutOfBlocksError
from hf_paged.cache._config import CacheConfig
from hf_paged.cache._kv_pool import KVLayout, KVPool

__all__ = ["BlockAllocator", "CacheConfig", "KVLayout", "KVPool", "OutOfBlocksError"]
