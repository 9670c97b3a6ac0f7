"""``CacheConfig``: the KV pool's settings, the one config of ``PagedAttentionCache`` and the engine.

``EngineConfig`` holds the same fields under the same names (its ``cache_config``), ``PagedAttentionCache`` takes
them as keywords or as ``cache_config=``, and the command line's flags are made from the fields' metadata, so each
setting has one name, one default, one meaning and one check, here.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from hf_paged.cache._kv_pool import CPU_MEMORY_SHARE, DEFAULT_MEMORY_BUDGET, KVLayout, blocks_for_budget
from hf_paged.cache._kv_quant import KV_CACHE_DTYPES, kv_storage_dtype

MAX_BLOCK_SIZE = 1024
#: Token slots a pool may hold: slot ids (``block * block_size + offset``) are int32.
MAX_SLOTS = 2**31 - 1
#: Sequences of the model's full length an automatically sized pool holds at most (an engine: its max_num_seqs).
DEFAULT_POOL_SEQUENCES = 256


def _flag(help: str, metavar: str | None = None) -> dict:
    return {"help": help, "metavar": metavar}


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a KV pool.

    Attributes:
        num_blocks: blocks in the pool; None sizes the pool from ``memory_budget``.
        block_size: tokens per block, 1 to 1024 (16 is a good default; flash-attn's paged kernels want 256).
        memory_budget: with ``num_blocks=None``, the fraction in (0, 1] of the free memory of each layer's device the
            pool may take (the tightest device decides), capped at what its owner can use (an engine: ``max_num_seqs``
            sequences of the model's full length; a ``PagedAttentionCache``: 256 of them). None (automatic): 0.8 of
            free memory, and on a CPU at most 3% of the machine's RAM (``CPU_MEMORY_SHARE``; there the memory is
            everyone's).
        kv_cache_dtype: what the pool stores: None or ``"auto"``, the model's dtype; ``"fp8"`` (``"fp8_e4m3"``):
            e4m3 with a float32 scale per layer and KV head, twice the blocks in the same memory.
        backend: the attention backends allowed, in the order tried: a name, names, or a comma-separated string
            (``hf_paged.available_backends()``); None: every one (flash, cuda, torch), or ``HF_PAGED_BACKEND``.
    """

    num_blocks: int | None = field(default=None, metadata=_flag(
        "KV blocks in the pool; 0 = as many as the memory budget holds", "N"))
    block_size: int = field(default=16, metadata=_flag("tokens per block", "N"))
    memory_budget: float | None = field(default=None, metadata=_flag(
        "the fraction of free device memory the KV pool may take, when its number of blocks is automatic (default: "
        f"{DEFAULT_MEMORY_BUDGET} of free memory, and on a CPU at most {CPU_MEMORY_SHARE} of all its RAM)", "F"))
    kv_cache_dtype: str | None = field(default=None, metadata=_flag(
        "what the KV pool stores: auto (the model's dtype) or fp8 (e4m3, half the bytes of bf16)", "DTYPE"))
    backend: str | tuple[str, ...] | None = field(default=None, metadata=_flag(
        "attention backends to allow, in order, e.g. 'cuda,torch' (default: flash, cuda, torch, the first that "
        "can serve)", "NAMES"))

    def __post_init__(self) -> None:
        if self.num_blocks is not None:
            positive_int("num_blocks", self.num_blocks, "or None (size the pool from free device memory)")
        positive_int("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks > MAX_SLOTS // self.block_size:
            raise ValueError(f"num_blocks={self.num_blocks} of {self.block_size} tokens is more token slots than a pool "
                             f"holds (2**31 - 1, int32 slot ids): give at most {MAX_SLOTS // self.block_size} blocks")
        budget = self.memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < budget <= 1:
                raise ValueError(f"memory_budget must be a fraction in (0, 1] of free device memory, or None "
                                 f"(automatic), got {budget!r}")
            object.__setattr__(self, "memory_budget", float(budget))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            kv_storage_dtype(self.kv_cache_dtype, None)  # raises, listing the accepted values
        object.__setattr__(self, "backend", backend_names(self.backend))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def pool_blocks(self, layout: KVLayout, dtype: torch.dtype, devices: Sequence[torch.device], cap: int) -> int:
        """The pool's size in blocks: ``num_blocks``, or as many as ``memory_budget`` holds for a model of ``layout``
        computing in ``dtype`` on ``devices`` (one per layer), at most ``cap`` (what the owner can use)."""
        if self.num_blocks is not None:
            return self.num_blocks
        kv_dtype = kv_storage_dtype(self.kv_cache_dtype, dtype)
        fits = blocks_for_budget(layout, self.block_size, kv_dtype, devices, self.memory_budget)
        return min(cap, fits, MAX_SLOTS // self.block_size)

    def blocks_for(self, sequences: int, tokens: int) -> int:
        """Blocks that hold ``sequences`` sequences of ``tokens`` tokens."""
        return sequences * -(-tokens // self.block_size)


def positive_int(name: str, value, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' ' + alternative if alternative else ''}, got {value!r}")


def backend_names(backend) -> tuple[str, ...] | None:
    """``backend`` as a tuple of names (a comma-separated string is split); whether each names a backend is checked
    where the backends are (``hf_paged.attention``'s dispatcher)."""
    if backend is None:
        return None
    if isinstance(backend, str):
        names = tuple(n.strip() for n in backend.split(","))
    elif isinstance(backend, Sequence) and all(isinstance(n, str) for n in backend):
        names = tuple(backend)
    else:
        raise ValueError(f"backend must be a name, a list of names or a comma-separated string, got {backend!r}")
    if not names or not all(names):
        raise ValueError(f"backend names an empty backend: {backend!r}")
    return names
