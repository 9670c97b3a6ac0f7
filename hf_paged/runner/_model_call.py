"""The engine's own model calls: the forward context they run in, and the call itself (token ids and positions, no
cache object, no mask). Eager steps (``ModelRunner``) and decode graphs (``DecodeGraphs``) both call through here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from hf_paged._forward_context import forward_context
from hf_paged.compile._layers import CompiledLayers
from hf_paged.attention._step import PagedStep


@contextmanager
def model_call(step: PagedStep, compiled: CompiledLayers | None, skinny: bool,
               local_logits: bool = False, layer_kernels: bool = False) -> Iterator[None]:
    """The context of the engine's own model calls: the step in the forward context, the skinny linear routing
    (``skinny``), a tensor-parallel ``lm_head``'s local logits (``local_logits``: ``hf_paged.parallel._logits``) and
    the layer kernels (``layer_kernels``, for calls without compiled layers) where asked, and the model's compiled
    layers where it has them."""
    with forward_context(step, skinny_linears=skinny, local_logits=local_logits,
                         layer_kernels=layer_kernels and compiled is None), \
            compiled.active() if compiled is not None else nullcontext():
        yield


# The attention mask of every own call: an empty 4-D tensor, which transformers' mask code hands to the layers as a
# prepared mask without looking at it (hf_paged's attention ignores it: the step is in the forward context). Given
# no mask and no cache, that code would instead probe position_ids for packed sequences, a host sync in every step
# (the host would wait for the device, which asynchronous scheduling avoids).
_NO_MASK: dict[torch.device, torch.Tensor] = {}


def call_model(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``model``'s ``[N, vocab]`` logits for a packed step ``ids``/``positions`` (``[1, T]``): no cache object and
    no attention mask (the forward context holds the step)."""
    if (mask := _NO_MASK.get(ids.device)) is None:
        mask = _NO_MASK[ids.device] = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=ids.device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False,
                logits_to_keep=logits_to_keep)
    return out.logits[0]
