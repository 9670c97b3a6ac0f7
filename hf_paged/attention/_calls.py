"""The attention calls a model's config implies, so that backends can be chosen (and refused) before the first step."""

from __future__ import annotations

import dataclasses

import torch

from hf_paged.attention.backends.base import AttentionCall
from hf_paged.attention._metadata import Phase
from hf_paged.cache._kv_pool import KVLayout


def _call(config, layout: KVLayout, phase: Phase, device_type: str, dtype: torch.dtype,
          block_size: int, kv_dtype: torch.dtype | None = None) -> AttentionCall:
    return AttentionCall(phase=phase, device_type=device_type, dtype=dtype, head_dim=layout.head_dim,
                         num_heads=config.get_text_config(decoder=True).num_attention_heads,
                         num_kv_heads=layout.num_kv_heads, block_size=block_size,
                         kv_dtype=None if kv_dtype == dtype else kv_dtype)


def basic_calls(config, layout: KVLayout, devices: list[torch.device], dtype: torch.dtype,
                block_size: int, kv_dtype: torch.dtype | None = None) -> list[AttentionCall]:
    """One call per phase and device type for this model's attention shape (without per-layer extras such as a
    sliding window): what any backend allowed for it must at least serve."""
    return [_call(config, layout, phase, device_type, dtype, block_size, kv_dtype)
            for device_type in sorted({d.type for d in devices}) for phase in Phase]


def decode_calls(config, layout: KVLayout, device_type: str, dtype: torch.dtype,
                 block_size: int, kv_dtype: torch.dtype | None = None) -> list[AttentionCall]:
    """The decode calls the model's layers will make, as far as its config tells (sliding window and logit
    softcapping included; ``kv_dtype``: an fp8 cache's dtype)."""
    call = _call(config, layout, Phase.DECODE, device_type, dtype, block_size, kv_dtype)
    text = config.get_text_config(decoder=True)
    extras = dataclasses.replace(call, sliding_window=getattr(text, "sliding_window", None),
                                 softcap=getattr(text, "attn_logit_softcapping", None))
    return [call] if extras == call else [call, extras]
