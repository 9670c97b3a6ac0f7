"""hf_paged: vLLM-style paged attention for HuggingFace transformers.

``import hf_paged`` registers ``attn_implementation="hf_paged"``; pass a :class:`PagedAttentionCache` to
``model.generate`` to run on paged memory.
"""

from hf_paged._version import __version__
from hf_paged.attention._dispatch import available_backends
from hf_paged.cache import BlockAllocator, OutOfBlocksError
from hf_paged.generate import PagedAttentionCache
from hf_paged.hf._register import ATTN_IMPLEMENTATION, register

register()


__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedAttentionCache",
    "available_backends",
]

from hf_paged.engine import Engine, EngineConfig  # noqa: E402
from hf_paged.engine._generate_batch import generate_batch  # noqa: E402
from hf_paged.generate._optimize import optimize_generate, restore_generate  # noqa: E402

__all__ += ["Engine", "EngineConfig", "generate_batch", "optimize_generate", "restore_generate"]
