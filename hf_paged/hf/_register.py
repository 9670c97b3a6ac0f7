"""Register ``"hf_paged"`` with transformers' attention and mask interfaces (done on ``import hf_paged``)."""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_paged import _compat
from hf_paged.hf._attention import paged_attention_forward, paged_mask

# transformers reads any name containing "flash" as a flash-attn kernel request: keep it out of ours.
#: The name to pass as ``attn_implementation`` (``from_pretrained(path, attn_implementation="hf_paged")``),
#: registered with transformers' attention and mask interfaces by ``import hf_paged``.
ATTN_IMPLEMENTATION = "hf_paged"
logger = logging.getLogger("hf_paged")


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the paged attention (with a log line) and warn if it is in training mode."""
    if _compat.attn_implementation(model.config) != ATTN_IMPLEMENTATION:
        logger.info("hf_paged: switching the model's attention to %r for the engine", ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.training:
        logger.warning("hf_paged: the model is in training mode (dropout on); call model.eval() before generating")
