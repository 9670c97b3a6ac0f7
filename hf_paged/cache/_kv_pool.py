"""The KV pool: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V tensor per layer plus the allocator.

Block ids are shared across layers: block ``b`` of a sequence means slot range ``[b * block_size, (b + 1) *
block_size)`` in every layer's tensors. A layer's tensors live on that layer's device (``layer_devices``), so a
model split with accelerate's ``device_map`` keeps each layer's KV next to its weights. An fp8 pool stores
``torch.float8_e4m3fn`` (1 byte an element) and a float32 scale per layer and KV head for K and V
(``kv_scales``; see :mod:`hf_paged.cache._kv_quant`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_paged.cache._kv_quant import KVScales, is_fp8, kv_storage_dtype, raw_bytes
from hf_paged.cache._block_allocator import BlockAllocator
from hf_paged.cache._config import CPU_MEMORY_SHARE, DEFAULT_MEMORY_BUDGET, MAX_SLOTS, CacheConfig

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV the model produces, read from its config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVLayout:
        text = config.get_text_config(decoder=True)
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(num_layers=text.num_hidden_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def scale_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the fp8 scales (float32, per layer and KV head, K and V); 0 for other dtypes."""
        return 2 * self.num_layers * self.num_kv_heads * 4 if is_fp8(dtype) else 0


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now (device memory for CUDA, available system memory for CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory_bytes(device: torch.device) -> int | None:
    """All the memory of ``device`` (device memory for CUDA, physical memory for CPU); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def pool_room(device: torch.device, budget: float | None, free: int) -> float:
    """Bytes a KV pool may take on ``device``, which has ``free`` bytes free: ``budget`` (a fraction) of them; None
    (automatic): ``DEFAULT_MEMORY_BUDGET`` of them, on a CPU at most ``CPU_MEMORY_SHARE`` of its RAM."""
    if budget is not None:
        return free * budget
    room = free * DEFAULT_MEMORY_BUDGET
    total = total_memory_bytes(device) if device.type == "cpu" else None
    return room if total is None else min(room, total * CPU_MEMORY_SHARE)


def describe_budget(budget: float | None, devices: Sequence[torch.device]) -> str:
    """What bounds a pool of ``budget`` on ``devices`` now, for a log line (``"80% of free memory"``)."""
    if budget is not None:
        return f"{budget:.0%} of free memory"
    for d in {torch.device(d) for d in devices}:
        free = free_memory_bytes(d)
        if pool_room(d, None, free) < free * DEFAULT_MEMORY_BUDGET:  # the CPU cap binds
            return f"{CPU_MEMORY_SHARE:.0%} of the machine's RAM (the automatic budget on a CPU)"
    return f"{DEFAULT_MEMORY_BUDGET:.0%} of free memory"


def blocks_for_budget(layout: KVLayout, block_size: int, dtype: torch.dtype, devices: Sequence[torch.device],
                      budget: float | None) -> int:
    """How many blocks fit in ``budget``: a fraction in (0, 1] of the free memory, or None, the automatic budget
    (``pool_room``).

    With layers on several devices, the budget applies to each device and the tightest device decides. ``dtype``
    is what the pool stores (1 byte an element for fp8, whose scales come off the budget first). ``budget`` is
    checked where it is given (``CacheConfig``).
    """
    per_block = layout.bytes_per_block(block_size, dtype)
    counts = Counter(torch.device(d) for d in devices)
    # Each device holds counts[d] of the layers: size by the device with the least room per layer.
    per_layer = min(pool_room(d, budget, free_memory_bytes(d)) / counts[d] for d in counts)
    num = int((per_layer * layout.num_layers - layout.scale_bytes(dtype)) // per_block)
    if num < 1:
        raise ValueError(
            f"a memory budget of {budget if budget is not None else describe_budget(None, devices)} holds no block "
            f"of {per_block} bytes (block_size={block_size}, {layout}); give a larger budget or a smaller block_size")
    return num


def pool_blocks(config: CacheConfig, layout: KVLayout, dtype: torch.dtype, devices: Sequence[torch.device],
                cap: int) -> int:
    """The size in blocks of the pool ``config`` describes: its ``num_blocks``, or as many as its ``memory_budget``
    holds for a model of ``layout`` computing in ``dtype`` on ``devices`` (one per layer), at most ``cap`` (what the
    owner can use)."""
    if config.num_blocks is not None:
        return config.num_blocks
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
    fits = blocks_for_budget(layout, config.block_size, kv_dtype, devices, config.memory_budget)
    return min(cap, fits, MAX_SLOTS // config.block_size)


class KVPool:
    """Per-layer paged K/V tensors and the block allocator that hands out their blocks."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 layer_devices: Sequence[torch.device]):
        if len(layer_devices) != layout.num_layers:
            raise ValueError(f"give one device, or one per decoder layer ({layout.num_layers}); got "
                             f"{len(layer_devices)}")
        # Refuse a pool larger than the memory of a device its layers are on, before anything is allocated (a pool
        # of 10**11 blocks would otherwise fill memory for minutes before it fails).
        per_layer = layout.bytes_per_block(block_size, dtype) // layout.num_layers * num_blocks
        for device, layers in Counter(torch.device(d) for d in layer_devices).items():
            total = total_memory_bytes(device)
            if total is not None and per_layer * layers > total:
                raise ValueError(f"num_blocks={num_blocks} would take {per_layer * layers / 2**30:.1f} GiB of KV cache "
                                 f"on {device}, which has {total / 2**30:.1f} GiB in all; give fewer blocks, or "
                                 "num_blocks=None to size the pool from free memory")
        self.layout, self.block_size, self.dtype = layout, block_size, dtype
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=d), torch.zeros(shape, dtype=dtype, device=d))
            for d in layer_devices
        ]
        # fp8 only: each layer's dequantization scales, on its device
        self.kv_scales: list[KVScales] | None = (
            [KVScales.unset(layout.num_kv_heads, d) for d in layer_devices] if is_fp8(dtype) else None)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i] -> dst[i]`` in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        for k_cache, v_cache in self.kv_caches:
            s = torch.tensor(src, device=k_cache.device)
            d = torch.tensor(dst, device=k_cache.device)
            for cache in (raw_bytes(k_cache), raw_bytes(v_cache)):
                cache.index_copy_(0, d, cache.index_select(0, s))

    def clear_scales(self) -> None:
        """Unset the fp8 scales, so the next write of each layer fixes them afresh (no-op for other dtypes)."""
        for scales in self.kv_scales or ():
            scales.clear()
