"""Register ``"hf_paged"`` with transformers' attention and mask interfaces (done on ``import hf_paged``)."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_paged.hf.attention import paged_attention_forward, paged_mask

# transformers reads any name containing "flash" as a flash-attn kernel request: keep it out of ours.
ATTN_IMPLEMENTATION = "hf_paged"


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
