"""``CacheConfig``: the KV pool's settings, the one config of ``PagedAttentionCache`` and the engine.

``EngineConfig`` holds the same fields under the same names (its ``cache_config``), ``PagedAttentionCache`` takes
them as keywords or as ``cache_config=``, and the command line's flags are made from the fields' metadata, so each
setting has one name, one default, one meaning and one check, here. It imports no torch, so that ``hf-paged --help``
builds its flags at once; what needs tensors (the pool's size in blocks: ``_kv_pool.pool_blocks``) is in the pool's
modules.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_BLOCK_SIZE = 1024
#: Token slots a pool may hold: slot ids (``block * block_size + offset``) are int32.
MAX_SLOTS = 2**31 - 1
#: Sequences of the model's full length an automatically sized pool holds at most (an engine: its max_num_seqs).
DEFAULT_POOL_SEQUENCES = 256
#: An automatic pool (``memory_budget=None``) takes at most this fraction of a device's free memory.
DEFAULT_MEMORY_BUDGET = 0.8
#: On a CPU an automatic pool also takes at most this share of all the machine's RAM: there "device memory" is the RAM
#: that everything else on the machine shares. On a 24 GB machine that is 0.7 GiB: about 16k tokens of SmolLM2-135M's
#: float32 KV (two sequences at its 8192 positions), and ``hf-paged serve`` on it stays under 2 GB resident.
CPU_MEMORY_SHARE = 0.03
#: The values of ``kv_cache_dtype``: None and "auto" keep the model's dtype; "fp8" and "fp8_e4m3" store e4m3.
KV_CACHE_DTYPES = (None, "auto", "fp8", "fp8_e4m3")
#: The attention backends (one module each in ``hf_paged/attention/backends``), in the order the dispatcher tries them.
BACKENDS = ("flash", "cuda", "torch")


def _flag(help: str, metavar: str | None = None) -> dict:
    return {"help": help, "metavar": metavar}


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a KV pool.

    Attributes:
        num_blocks: blocks in the pool; None sizes the pool from ``memory_budget``.
        block_size: tokens per block, 1 to 1024 (16 is a good default; flash-attn's paged kernels want 256).
        memory_budget: with ``num_blocks=None``, the fraction in (0, 1] of the free memory of each layer's
            device the pool may take (the tightest device decides), capped at what its owner can use (an engine:
            ``max_num_seqs`` sequences of the model's full length; a ``PagedAttentionCache``: 256 of them). None
            (automatic): 0.8 of free memory, and on a CPU at most 3% of the machine's RAM (``CPU_MEMORY_SHARE``; there
            the memory is everyone's). A number of bytes is not taken: ``num_blocks`` gives a pool of an exact size.
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
                raise ValueError(f"memory_budget must be a fraction in (0, 1] of free device memory (a float: 0.5, "
                                 f"1.0), or None (automatic); for a pool of an exact size pass num_blocks; got "
                                 f"{budget!r}")
            object.__setattr__(self, "memory_budget", float(budget))
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "backend", backend_names(self.backend))

    def blocks_for(self, sequences: int, tokens: int) -> int:
        """Blocks that hold ``sequences`` sequences of ``tokens`` tokens."""
        return sequences * -(-tokens // self.block_size)


def config_or_keywords(cls: type, config, name: str, what: str, **settings):
    """``config`` (a ``cls``), or one built from keyword ``settings``; a config beside a keyword off its default is
    refused, as is a config of another type. ``name``: the config's argument; ``what``: what its settings are of."""
    if config is None:
        return cls(**settings)
    if not isinstance(config, cls):
        hint = f": pass {cls.__name__}(**settings)" if isinstance(config, dict) else ""
        raise ValueError(f"{name} must be an hf_paged.{cls.__name__}, got {type(config).__name__}{hint}")
    if changed := [key for key, value in settings.items() if value != getattr(cls, key)]:  # (defaults: the class's)
        raise ValueError(f"give {what} either as {name}={cls.__name__}(...) or as keywords, not both (got {name} and "
                         f"{', '.join(changed)})")
    return config


def positive_int(name: str, value, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' ' + alternative if alternative else ''}, got {value!r}")


def check_kv_cache_dtype(kv_cache_dtype) -> None:
    """``ValueError`` listing the accepted values unless ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`."""
    if not (kv_cache_dtype is None or isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (None and 'auto' keep the model's dtype), "
                         f"got {kv_cache_dtype!r}")


def backend_names(backend) -> tuple[str, ...] | None:
    """``backend`` as a tuple of names (a comma-separated string is split), each one of :data:`BACKENDS`."""
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
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown attention backend(s) {unknown}; choose from {list(BACKENDS)}")
    return names
