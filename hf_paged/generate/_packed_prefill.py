"""``optimize_generate``'s prefill: the prompt forward of a ``generate`` batch run packed, as hf_paged's own call.

``generate`` runs a batch's prompts as one ``[batch, columns]`` forward, left-padded to the longest prompt. On a
:class:`PagedAttentionCache` attention already reads and writes the real tokens only, but everything around it (the
matrix products, norms, rotary, the MLP) runs on the padding too, in the model's eager modules: on an H200, 64
prompts of 256-768 tokens (68% of the grid real) spent 117.6 ms in matrix products and ~98 ms in the eager modules'
elementwise kernels of a 238.6 ms prompt forward (Llama-3.2-1B shape, bf16; profiled).

:class:`PackedPrefill`, which ``optimize_generate`` sets as ``model.forward``, runs such a forward the way the
engine runs a prefill: the cache plans the step as usual (from the padding mask, or the plan ``generate`` made
before the call), the real tokens go in one row (``[1, T]``, with the positions ``generate`` gave them), the step
sits in the forward context, the model's compiled layers serve the call, and only each row's last token reaches
``lm_head``. It returns what the usual forward returns: the model's output class with ``[batch, 1, vocab]`` logits
and the cache.

Every other call goes to the forward the model had: decode steps, hf_paged's own calls, a traced call, another
cache, ``inputs_embeds`` or other tensor inputs (token types, images), output flags, logits of more than the last
position, no positions given, a row with no new token, a batch of one row (:data:`MIN_ROWS`), a model off the
devices served (CUDA).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from hf_paged import _forward_context
from hf_paged.attention._step import PagedStep
from hf_paged.compile._layers import CompiledLayers
from hf_paged.generate._adapter import planned_step
from hf_paged.generate._paged_cache import PagedAttentionCache
from hf_paged.hf.compat import cache_in
from hf_paged.runner._model_call import model_call

#: The fewest rows a packed prompt forward takes. One row has no padding to drop, and its one-token decode steps
#: (``[1, 1]``: torch.compile treats a size of one apart) trace the compiled layers apart from a ``[1, T]`` prompt: a
#: packed prompt would add a trace to a process's first call (~4 s; a second process ~1.5-2 s, as an engine's
#: one-row graph cost, ``engine_start_h200_2026-12-02.json``) to save the eager elementwise kernels of one prompt
#: (~2 us a token at the 1B shape on an H200, ~1 ms for 512 tokens).
MIN_ROWS = 2

_PASSED = ("use_cache", "return_dict")  # flags passed on as they are
_DROPPED = ("cache_position",)  # tensors the packed call leaves out: it gives the positions itself
_READ = ("input_ids", "position_ids", "attention_mask", "logits_to_keep", "cache", "past_key_values", *_DROPPED)


class PackedPrefill:
    """``model.forward`` under ``optimize_generate`` (see the module docstring). ``inner``: the forward the model had
    (bound); ``compiled``: the model's compiled layers (or None); ``skinny``: route the linears through the skinny
    kernel; ``devices``: the device types served (the CPU tests drive it with ``("cpu",)``)."""

    def __init__(self, model: torch.nn.Module, inner, compiled: CompiledLayers | None, skinny: bool,
                 devices: tuple[str, ...] = ("cuda",)):
        self.config, self.inner, self.compiled, self.skinny = model.config, inner, compiled, skinny
        self.devices = devices
        self.packed = 0  # forwards run packed
        functools.update_wrapper(self, inner)  # generate reads the forward's signature (position_ids, logits_to_keep)

    def __call__(self, *args, **kwargs):
        if args or torch.compiler.is_compiling() or _forward_context.in_own_call() or not self._served(kwargs):
            return self.inner(*args, **kwargs)
        ids = kwargs["input_ids"]
        batch, width = ids.shape
        cache = cache_in(kwargs)
        step = planned_step(kwargs.get("attention_mask"))
        if step is None:  # a 2D padding mask (or none): planned here as the mask function would
            step = cache.plan_forward(self.config, kwargs.get("attention_mask"), batch, width, ids.device).step
        meta = step.metadata.on(ids.device)
        cu_seqlens = meta.cu_seqlens_q
        if not bool((cu_seqlens[1:] > cu_seqlens[:-1]).all()):  # a row without a new token has no logits to give
            return self.inner(*args, **kwargs)
        index = meta.token_index  # the real tokens of the [batch, width] grid, in order (None: all are real)
        packed_ids, positions = (t.reshape(1, -1) if index is None else t.reshape(-1)[index].view(1, -1)
                                 for t in (ids, kwargs["position_ids"]))
        packed = PagedStep(dataclasses.replace(meta, token_index=None, grid=(1, meta.num_tokens)), step.pool,
                           step.dispatcher)
        passed = {key: value for key, value in kwargs.items() if key not in _DROPPED}
        passed.update(input_ids=packed_ids, position_ids=positions, attention_mask=None,
                      logits_to_keep=cu_seqlens[1:].long() - 1)
        with torch.no_grad(), model_call(packed, self.compiled, self.skinny):
            out = self.inner(**passed)
        out.logits = out.logits.view(batch, 1, -1)
        cache.mark_step_read()  # (the layers' cache.update calls do so too)
        self.packed += 1
        return out

    def _served(self, kwargs: dict) -> bool:
        """Whether a call is a prompt forward this class runs: token ids of two rows or more and more than one
        column, and their positions (as ``generate`` gives them: a forward without them counts padding columns as
        positions), on a paged cache, the last position's logits only, and no input or flag beyond the known ones."""
        ids = kwargs.get("input_ids")
        positions = kwargs.get("position_ids")
        if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[0] >= MIN_ROWS and ids.shape[1] > 1
                and isinstance(positions, torch.Tensor) and positions.shape == ids.shape
                and type(kwargs.get("logits_to_keep")) is int and kwargs["logits_to_keep"] == 1  # (not True)
                and ids.device.type in self.devices and isinstance(cache_in(kwargs), PagedAttentionCache)):
            return False
        mask = kwargs.get("attention_mask")
        if not (mask is None or planned_step(mask) is not None or (isinstance(mask, torch.Tensor) and mask.ndim == 2)):
            return False
        # every other argument: None, a flag passed on (a bool), or an output flag left off
        return all(name in _READ or value is None or (isinstance(value, bool) if name in _PASSED
                                                      else name.startswith("output_") and not value)
                   for name, value in kwargs.items())
