"""The ``"hf_paged"`` attention and mask functions registered with transformers.

Each forward's :class:`~hf_paged.attention.PagedStep` reaches the attention function by one of two doors, one for
each kind of caller:

- **hf_paged's own model calls** (the engine's steps, decode steps captured in CUDA graphs) pass token ids and
  positions only and set the step in the forward context (``hf_paged._forward_context``) for the call; the mask
  function then builds no mask, and every layer reads the step there.
- **transformers' ``generate``** calls the forward itself; a :class:`~hf_paged.PagedAttentionCache` passed to it
  plans each forward from the padding mask. The step reaches every layer as its ``attention_mask``, a
  :class:`StepMask`, which the mask function gets from the cache that the query offset carries (how, and why so:
  ``hf_paged/generate/_adapter.py``).

Without either, an inference forward that starts from nothing with plain causal attention (a plain
``model(input_ids)`` under ``torch.no_grad()``, the prompt forward on a cache transformers made) runs paged all the
same, on a KV that lives for that forward (``hf_paged.hf._transient``); any other (decode steps on such a cache, extra
mask functions, autograd on) falls back to transformers' SDPA path, which gives the same results on a contiguous
cache.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_paged import _forward_context
from hf_paged.attention._step import PagedStep, attend, attend_packed, pack
from hf_paged.hf._transient import fresh_step

logger = logging.getLogger("hf_paged")

_UNSERVED_KWARGS = {"s_aux": "attention sinks", "position_bias": "additive position bias"}


class StepMask:
    """A ``generate`` forward's step as its attention mask. transformers' mask code passes a prepared mask through
    where it is asked for one again (a compiled step's masks are made before the call) and tells a prepared mask
    from a padding mask by ``ndim``; a plain object, so compiled code takes no guard on its contents."""

    __slots__ = ("step",)
    ndim = 4

    def __init__(self, step: PagedStep):
        self.step = step


class FreshMask(StepMask):
    """The step of a forward that starts from nothing, on a :class:`~hf_paged.hf._transient.TransientKV`, and the SDPA
    mask of the same forward for a layer the transient KV cannot hold (made when first asked; never compiled)."""

    def __init__(self, step: PagedStep, sdpa_args: dict):
        super().__init__(step)
        self.sdpa_args = sdpa_args

    @functools.cached_property
    def sdpa(self):
        return sdpa_mask(**self.sdpa_args)


def paged_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, **kwargs):
    """Mask function for ``"hf_paged"`` (see the module docstring): no mask in hf_paged's own calls, the planned
    step for a query offset that carries a planning cache (its ``planner``), else transformers' SDPA mask."""
    if isinstance(kwargs.get("attention_mask"), StepMask):  # planned before a compiled forward: passed on
        return kwargs["attention_mask"]
    if _forward_context.current_step() is not None:
        return None
    if (planner := getattr(q_offset, "planner", None)) is None:
        sdpa_args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                         kv_offset=kv_offset, **kwargs)
        # plain causal attention over the forward's own tokens only (nothing cached before them; transformers allows
        # the causal skip: no extra mask function, no packed sequences, not compiled), and no autograd (the paged
        # path serves no gradients): run paged on a transient KV
        if (not torch.compiler.is_compiling() and not torch.is_grad_enabled() and kwargs.get("allow_is_causal_skip")
                and int(q_offset) == 0 and kv_offset == 0 and kv_length == q_length):
            step = fresh_step(kwargs.get("config"), kwargs.get("attention_mask"), batch_size, q_length,
                              kwargs.get("device") or torch.device("cpu"))
            if step is not None:
                return FreshMask(step, sdpa_args)
        _note_dense_fallback()
        return sdpa_mask(**sdpa_args)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "hf_paged: a compiled forward on a PagedAttentionCache must get its step planned beforehand, as its "
            "attention_mask: generate does so for a cache whose is_compileable is True (give the cache "
            "max_new_tokens=...), and only decode steps may be compiled")
    return planner.plan_forward(kwargs.get("config"), kwargs.get("attention_mask"), batch_size, q_length,
                                kwargs.get("device"))


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """Attention for ``attn_implementation="hf_paged"``.

    Args:
        query: ``[batch, H, q_len, D]``.
        key, value: ``[batch, Hkv, q_len, D]``, the forward's new tokens (``[batch, Hkv, kv_len, D]`` on the dense
            fallback).
        attention_mask: a :class:`StepMask` (``generate`` on a paged cache), an SDPA mask (the dense fallback), or
            in hf_paged's own calls a placeholder it ignores (the step is in the forward context).

    Returns:
        ``([batch, q_len, H, D], None)``; padding positions are zero.
    """
    if _forward_context.in_own_call():
        # hf_paged's own calls: every token real, packed in one row (or one token per row), the step in the context.
        # Packed here, in the layer's compiled code where it has one, so that the packing fuses into what made q/k/v.
        batch, num_heads, q_len, head_dim = query.shape
        q, k, v = pack(query, None), pack(key, None), pack(value, None)
        out = _own_call_attention(module, q, k, v, scaling, dropout, sliding_window, softcap, kwargs)
        return out.view(batch, q_len, num_heads, head_dim), None
    if isinstance(attention_mask, StepMask) and attention_mask.step.metadata.static and (
            torch.compiler.is_compiling()):
        _check_served(module, dropout, kwargs)
        return attend(attention_mask.step, module.layer_idx, query, key, value, scaling, sliding_window, softcap,
                      traced=True), None
    return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                            kwargs)


# Opaque to torch.compile: a compiled layer (the engine's CompiledLayers) breaks its graph here, and the KV write and
# attention run as they do eager, on the step in the forward context.
@torch.compiler.disable
def _own_call_attention(module, q, k, v, scaling, dropout, sliding_window, softcap, kwargs: dict) -> torch.Tensor:
    step = _forward_context.current_step()
    if step is None or step.metadata.token_index is not None:
        raise RuntimeError("hf_paged: a model call of another thread ran while one of hf_paged's own calls did; a "
                           "model serves one hf_paged call at a time")
    _check_served(module, dropout, kwargs)
    return attend_packed(step, module.layer_idx, q, k, v, scaling, sliding_window, softcap)


@torch.compiler.disable
def _eager_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                     kwargs: dict) -> tuple[torch.Tensor, None]:
    step = attention_mask.step if isinstance(attention_mask, StepMask) else None
    if isinstance(attention_mask, FreshMask) and (module.training or not step.pool.claim(module.layer_idx, key)):
        attention_mask, step = attention_mask.sdpa, None  # a layer the forward's transient KV cannot hold
    if step is None:
        return _dense_fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               sliding_window=sliding_window, softcap=softcap, **kwargs)
    _check_served(module, dropout, kwargs)
    return attend(step, module.layer_idx, query, key, value, scaling, sliding_window, softcap), None


def _dense_fallback(module, query, key, value, mask, softcap: float | None = None, **kwargs):
    """Attention without a paged cache: transformers' SDPA path, or, for logit softcapping (which SDPA does not
    serve), the model's own eager attention on the same (boolean) mask turned additive."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            "logit softcapping without a PagedAttentionCache needs the model's eager attention, which this model's "
            'module does not define; pass a PagedAttentionCache, or load the model with attn_implementation="eager"')
    # the SDPA mask (boolean, True = attend, or None = plain causal) as eager attention's additive float mask
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, softcap=softcap, **kwargs)


@functools.lru_cache(maxsize=1)
def _note_dense_fallback() -> None:
    logger.warning(
        "hf_paged: this forward runs dense through SDPA: it continues a cache that is not a PagedAttentionCache, has "
        "extra mask functions, or records gradients. Pass hf_paged.PagedAttentionCache(...) to generate "
        "(hf_paged.with_cache), or call the model under torch.no_grad(), to use paged attention.")


def _check_served(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("hf_paged serves causal self-attention only (this layer is non-causal)")
    if dropout and module.training:
        raise NotImplementedError("hf_paged is an inference path: attention dropout in training is not served")
    for name, feature in _UNSERVED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hf_paged does not serve {feature} ({name}); use attn_implementation='eager'")
