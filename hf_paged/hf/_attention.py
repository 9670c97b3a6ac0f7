"""The ``"hf_paged"`` attention and mask functions registered with transformers.

With a :class:`~hf_paged.PagedAttentionCache`, the mask function plans the step once per forward and returns
the plan (a :class:`PagedMetadata`), which transformers hands to every layer as ``attention_mask``. Without one
(``generate`` made its own ``DynamicCache``), both functions fall back to transformers' SDPA path, which gives the
same results on a contiguous cache.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_paged.attention import _ops as ops
from hf_paged.attention.backends.base import AttentionCall, AttentionParams
from hf_paged.attention._metadata import PagedMetadata, Phase

logger = logging.getLogger("hf_paged")

# True while the engine's compiled layers run (``hf_paged.compile._layers``): the traced code then hands the
# step's plan to the eager path without looking into it. Touching the plan while tracing would make the compiler
# guard on its fields (the phase, a batch of one sequence), and every new combination would compile again mid-run.
opaque_plans = False

_UNSERVED_KWARGS = {
    "s_aux": "attention sinks",
    "position_bias": "additive position bias",
}


def paged_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, **kwargs):
    """Mask function for ``"hf_paged"``: the step plan when a paged cache is in use, else an SDPA mask.

    A forward may be handed its plan ready-made as ``attention_mask`` (``generate`` builds the masks of a
    compileable cache before calling the, possibly compiled, forward): it is passed on as it is.
    """
    if isinstance(kwargs.get("attention_mask"), PagedMetadata):
        return kwargs["attention_mask"]
    cache = getattr(q_offset, "paged_cache", None)
    if cache is None:
        _note_dense_fallback()
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=int(q_offset), kv_offset=kv_offset, **kwargs)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "hf_paged: a compiled forward on a PagedAttentionCache must get its step planned beforehand, as its "
            "attention_mask: generate does so for a cache whose is_compileable is True (give the cache "
            "max_new_tokens=...), and only decode steps may be compiled")
    return plan_forward(cache, kwargs.get("config"), kwargs.get("attention_mask"), batch_size, q_length,
                        kwargs.get("device"))


def plan_forward(cache, config, attention_mask, batch_size: int, q_length: int, device=None):
    """The plan of a forward on paged ``cache`` (what the mask function returns): ``attention_mask`` the 2D
    padding mask or None, ``device`` where the plan's tensors go (default: the pool's first device)."""
    cache.check_model_config(config)
    plan = cache.plan_step(attention_mask, batch_size, q_length, device or cache.pool.kv_caches[0][0].device)
    if cache.is_compileable:
        _prepare_routes(plan)
    return SealedPlan(plan) if opaque_plans else plan


class SealedPlan:
    """A step's plan as the engine's compiled layers hand it from layer to layer: a plain object whose contents the
    compiler never sees (a dataclass would be taken apart and guarded field by field)."""

    __slots__ = ("plan",)

    def __init__(self, plan: PagedMetadata):
        self.plan = plan


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for ``attn_implementation="hf_paged"``.

    Args:
        query: ``[batch, H, q_len, D]``.
        key, value: ``[T, Hkv, D]``, the real new tokens packed by ``PagedAttentionCache.update``
            (``[batch, Hkv, kv_len, D]`` on the dense fallback).
        attention_mask: the step's :class:`PagedMetadata` (a tensor or None on the dense fallback).

    Returns:
        ``([batch, q_len, H, D], None)``; padding positions are zero.
    """
    if opaque_plans:
        return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                                kwargs)
    if not isinstance(attention_mask, PagedMetadata):
        return _dense_fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               sliding_window=sliding_window, softcap=softcap, **kwargs)
    if attention_mask.static and torch.compiler.is_compiling():
        _check_served(module, dropout, kwargs)
        return _static_decode_attention(module, query, key, value, attention_mask, scaling, sliding_window, softcap)
    return _paged_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                            kwargs)


def _static_decode_attention(module, query, key, value, meta: PagedMetadata, scaling, sliding_window,
                             softcap) -> tuple[torch.Tensor, None]:
    """A decode step of fixed shapes being compiled (``hf_paged/generate/_static_decode.py``): traced, with the KV
    write and the attention as custom ops (opaque to the compiler, the same backends underneath). One real token
    per row, so no packing; the layer's backend was chosen before the compiled call."""
    batch, num_heads, _, head_dim = query.shape
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    backend, writer, params = _route(meta, query, k_cache, scaling, sliding_window, softcap)
    q = query.transpose(1, 2).reshape(batch, num_heads, head_dim)
    scales = None if meta.kv_scales is None else meta.kv_scales[module.layer_idx]  # an fp8 cache's
    ops.store_kv(key, value, k_cache, v_cache, meta, writer, scales)
    out = ops.paged_attention(q, key, value, k_cache, v_cache, meta, backend, params, scales)
    return out.view(batch, 1, num_heads, head_dim), None


@torch.compiler.disable
def _eager_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                     kwargs: dict) -> tuple[torch.Tensor, None]:
    """``paged_attention_forward`` out of the compiler's sight (see ``opaque_plans``)."""
    if isinstance(attention_mask, SealedPlan):
        attention_mask = attention_mask.plan
    if not isinstance(attention_mask, PagedMetadata):
        return _dense_fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               sliding_window=sliding_window, softcap=softcap, **kwargs)
    return _paged_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                            kwargs)


# Opaque to torch.compile: a compiled layer (the engine's CompiledLayers) breaks its graph here and the KV write and
# attention run as they do eager, with the step's metadata as it is.
@torch.compiler.disable
def _paged_attention(module, query, key, value, attention_mask: PagedMetadata, scaling, dropout, sliding_window,
                     softcap, kwargs: dict) -> tuple[torch.Tensor, None]:
    _check_served(module, dropout, kwargs)
    batch, num_heads, q_len, head_dim = query.shape
    meta = attention_mask.on(query.device)
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    if meta.token_index is not None:
        q = q.index_select(0, meta.token_index)
    backend, writer, params = _route(meta, query, k_cache, scaling, sliding_window, softcap)
    if meta.kv_scales is None:
        writer.write_kv(key, value, k_cache, v_cache, meta)
        out = backend.forward(q, key, value, k_cache, v_cache, meta, params)
    else:  # an fp8 cache (backends that cannot read one refuse it, so they never get here)
        scales = meta.kv_scales[module.layer_idx]
        writer.write_kv(key, value, k_cache, v_cache, meta, kv_scales=scales)
        out = backend.forward(q, key, value, k_cache, v_cache, meta, params, kv_scales=scales)
    if meta.token_index is None:
        return out.view(batch, q_len, num_heads, head_dim), None
    full = out.new_zeros(batch * q_len, num_heads, head_dim).index_copy_(0, meta.token_index, out)
    return full.view(batch, q_len, num_heads, head_dim), None


def _route(meta: PagedMetadata, query: torch.Tensor, k_cache: torch.Tensor, scaling: float | None,
           sliding_window: int | None, softcap: float | None) -> tuple:
    """The backend, KV writer and params serving this layer in this phase (chosen once, then looked up in the
    dispatcher's ``routes``: (phase, layer shape, scalars) -> (backend, KV writer, params), so that a layer looks
    up a plain tuple instead of building and hashing an AttentionCall and its params every step)."""
    _, num_heads, _, head_dim = query.shape
    key = (meta.phase, query.dtype, query.device.type, num_heads, head_dim, k_cache.shape[2], meta.block_size,
           scaling, sliding_window, softcap)
    route = meta.dispatcher.routes.get(key)
    if route is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "hf_paged: a compiled forward met an attention layer whose backend was not chosen beforehand; "
                "compile decode steps only, after an eager forward of the batch (generate's prefill)")
        route = meta.dispatcher.routes[key] = _choose_route(key, meta.dispatcher, k_cache)
    return route


def _choose_route(key: tuple, dispatcher, k_cache: torch.Tensor) -> tuple:
    phase, dtype, device_type, num_heads, head_dim, num_kv_heads, block_size, scaling, sliding_window, softcap = key
    call = AttentionCall(phase=phase, device_type=device_type, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, block_size=block_size, sliding_window=sliding_window,
                         softcap=softcap, kv_dtype=None if k_cache.dtype == dtype else k_cache.dtype)
    params = AttentionParams(scale=head_dim**-0.5 if scaling is None else scaling, sliding_window=sliding_window,
                             softcap=softcap)
    return dispatcher.select(call), dispatcher.writer(k_cache), params


def _prepare_routes(plan: PagedMetadata) -> None:
    """Before a forward that may be compiled: choose the decode backend of every layer shape an eager forward
    has met, so that compiled layers only look their route up (choosing runs host code a compiler cannot trace)."""
    routes = plan.dispatcher.routes
    if plan.phase is Phase.DECODE:
        for key in [k for k in routes if k[0] is not Phase.DECODE and (Phase.DECODE, *k[1:]) not in routes]:
            routes[(Phase.DECODE, *key[1:])] = _choose_route((Phase.DECODE, *key[1:]), plan.dispatcher,
                                                             plan.kv_caches[0][0])


def _dense_fallback(module, query, key, value, attention_mask, softcap: float | None = None, **kwargs):
    """Attention without a paged cache: transformers' SDPA path, or, for logit softcapping (which SDPA does not
    serve), the model's own eager attention on the same (boolean) mask turned additive."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            "logit softcapping without a PagedAttentionCache needs the model's eager attention, which this model's "
            'module does not define; pass a PagedAttentionCache, or load the model with attn_implementation="eager"')
    return eager(module, query, key, value, _additive_mask(attention_mask, query, key), softcap=softcap, **kwargs)


def _additive_mask(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """An SDPA mask (boolean, True = attend, or None = plain causal) as eager attention's additive float mask."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, torch.finfo(query.dtype).min)


@functools.lru_cache(maxsize=1)
def _note_dense_fallback() -> None:
    logger.warning(
        "hf_paged: no PagedAttentionCache in this forward, so attention runs dense through SDPA. Pass "
        "past_key_values=hf_paged.PagedAttentionCache(...) to generate to use paged memory."
    )


def _check_served(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("hf_paged serves causal self-attention only (this layer is non-causal)")
    if dropout and module.training:
        raise NotImplementedError("hf_paged is an inference path: attention dropout in training is not served")
    for name, feature in _UNSERVED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hf_paged does not serve {feature} ({name}); use attn_implementation='eager'")
