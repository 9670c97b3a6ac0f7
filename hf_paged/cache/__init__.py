"""The KV pool and its bookkeeping: the block allocator, the per-layer K/V tensors, and the engine's block manager.

The names below are imported on first use (``hf_paged/_lazy.py``): ``CacheConfig``'s module imports no torch.
"""

from hf_paged._lazy import lazy_exports

_LAZY = {
    "BlockAllocator": "hf_paged.cache._block_allocator",
    "CacheConfig": "hf_paged.cache._config",
    "KVLayout": "hf_paged.cache._kv_pool",
    "KVPool": "hf_paged.cache._kv_pool",
    "OutOfBlocksError": "hf_paged.cache._block_allocator",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
