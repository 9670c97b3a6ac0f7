"""``PagedStep``: what every attention layer of one forward needs, and the layer's paged attention on it.

A step is its :class:`~hf_paged.attention.PagedMetadata` (plain step data), the :class:`~hf_paged.cache.KVPool` its
layers write and read, and the :class:`~hf_paged.attention.Dispatcher` that picks each layer's backend; it keeps what
its layers share, made by the first that needs it: the metadata copied to each device, and each backend's plan of the
step there (``AttentionBackend.plan``). The engine's runner builds one per model call; ``PagedAttentionCache`` builds
one per ``generate`` forward (one per batch for fixed-shape decode steps, whose metadata changes in place).

:func:`attend` is one layer's work on a step: pack the new tokens, write their K/V into the pool (the backend's KV
write), and attend through the block tables. It holds no transformers code: the ``"hf_paged"`` attention function
(``hf_paged.hf``) calls it with the layer's tensors.

Shapes (``batch x q_len`` the caller's token grid, ``T`` its real tokens, ``H`` query heads, ``Hkv`` KV heads, ``D``
head_dim):
    query:       [batch, H, q_len, D]
    key, value:  [batch, Hkv, q_len, D]
    output:      [batch, q_len, H, D]; padding positions are zero
"""

from __future__ import annotations

import torch

from hf_paged.attention import _ops as ops
from hf_paged.attention._dispatch import Dispatcher
from hf_paged.attention._metadata import PagedMetadata, Phase
from hf_paged.attention.backends.base import AttentionBackend, AttentionCall, AttentionInputs, AttentionParams
from hf_paged.cache._kv_pool import KVPool


class PagedStep:
    """One forward's paged attention state. A plain object (not a dataclass), so that compiled code that passes it
    along takes no guard on its contents."""

    __slots__ = ("metadata", "pool", "dispatcher", "_shared")

    def __init__(self, metadata: PagedMetadata, pool: KVPool, dispatcher: Dispatcher):
        self.metadata, self.pool, self.dispatcher = metadata, pool, dispatcher
        self._shared: dict = {}  # device -> the metadata there; (backend, device) -> its plan

    def on(self, device: torch.device) -> PagedMetadata:
        """The step's metadata on ``device``, copied once per step and device (layers split over devices under
        ``device_map`` each read the copy on their own)."""
        if device not in self._shared:
            self._shared[device] = self.metadata.on(device)
        return self._shared[device]

    def plan(self, backend: AttentionBackend, device: torch.device):
        """``backend``'s plan of the step on ``device`` (:meth:`AttentionBackend.plan`), made once per step and
        device."""
        key = (backend, device)
        if key not in self._shared:
            self._shared[key] = backend.plan(self.on(device))
        return self._shared[key]

    def __repr__(self) -> str:
        meta = self.metadata
        return f"PagedStep({meta.phase.value}, seqs={meta.num_seqs}, tokens={meta.num_tokens})"


def attend(step: PagedStep, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None, sliding_window: int | None, softcap: float | None,
           traced: bool = False) -> torch.Tensor:
    """Layer ``layer_idx``'s paged attention: returns ``[batch, q_len, H, D]``. ``traced``: a decode step of fixed
    shapes being compiled (``metadata.static``, one real token per row), see :func:`attend_packed`."""
    batch, num_heads, q_len, head_dim = query.shape
    index = None if traced else step.on(query.device).token_index
    out = attend_packed(step, layer_idx, pack(query, index), pack(key, index), pack(value, index), scaling,
                        sliding_window, softcap, traced)
    if index is not None:  # padding positions stay zero
        out = out.new_zeros(batch * q_len, num_heads, head_dim).index_copy_(0, index, out)
    return out.view(batch, q_len, num_heads, head_dim)


def attend_packed(step: PagedStep, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scaling: float | None, sliding_window: int | None, softcap: float | None,
                  traced: bool = False) -> torch.Tensor:
    """:func:`attend` on the step's real tokens, packed: ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]``; returns
    ``[T, H, D]``. Keys that do not fit the layer's pool tensors (another model's cache) or sit on another device
    are refused (``ValueError``). ``traced``: the KV write and the attention run as custom ops (opaque to the
    compiler, the same backends underneath), the layer's backend chosen before the compiled call
    (:func:`choose_decode_routes`), and nothing checked that would guard the compiled code."""
    layout, caches = step.pool.layout, step.pool.kv_caches
    if not traced and (layer_idx >= len(caches) or k.shape[-2] != layout.num_kv_heads
                       or k.shape[-1] != layout.head_dim):
        raise ValueError(
            f"this cache was built for another model ({layout}) but layer {layer_idx} produces {k.shape[-2]} KV "
            f"heads of {k.shape[-1]}; build the cache from this model's config (PagedAttentionCache(model.config, "
            "...))")
    k_cache, v_cache = caches[layer_idx]
    if not traced and k.device != k_cache.device:
        raise ValueError(
            f"layer {layer_idx} runs on {k.device} but its KV cache is on {k_cache.device}; create the cache with "
            "device=model.device (or one device per layer for a split model)")
    backend, writer, params = route(step, q, k_cache, scaling, sliding_window, softcap)
    scales = None if step.pool.kv_scales is None else step.pool.kv_scales[layer_idx]  # an fp8 pool's
    if traced:
        ops.store_kv(k, v, k_cache, v_cache, step.metadata, writer, scales)
        return ops.paged_attention(q, k, v, k_cache, v_cache, step.metadata, backend, params, scales)
    device = q.device
    meta = step.on(device)
    writer.write_kv(k, v, k_cache, v_cache, meta, scales)
    return backend.forward(AttentionInputs(q, k, v, k_cache, v_cache, meta, params, scales), step.plan(backend, device))


def pack(states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``[batch, H, q_len, D]`` -> ``[T, H, D]`` keeping the real tokens (``index`` into the grid; None = all)."""
    batch, heads, q_len, dim = states.shape
    flat = states.transpose(1, 2).reshape(batch * q_len, heads, dim)
    return flat if index is None else flat.index_select(0, index)


def route(step: PagedStep, query: torch.Tensor, k_cache: torch.Tensor, scaling: float | None,
          sliding_window: int | None, softcap: float | None) -> tuple:
    """The backend, KV writer and params serving this layer (``query``: its packed ``[T, H, D]``) in this phase:
    chosen once, then looked up in the dispatcher's ``routes`` (phase, layer shape, scalars) -> (backend, KV writer,
    params), a plain tuple lookup per layer and step instead of building and hashing an AttentionCall."""
    meta = step.metadata
    num_heads, head_dim = query.shape[-2:]
    key = (meta.phase, query.dtype, query.device.type, num_heads, head_dim, k_cache.shape[2], meta.block_size,
           scaling, sliding_window, softcap)
    found = step.dispatcher.routes.get(key)
    if found is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "hf_paged: a compiled forward met an attention layer whose backend was not chosen beforehand; "
                "compile decode steps only, after an eager forward of the batch (generate's prefill)")
        if query.dtype != k_cache.dtype and step.pool.kv_scales is None:
            raise ValueError(f"the model computes {query.dtype} but the KV pool holds {k_cache.dtype}; create the "
                             "cache with dtype=model.dtype")
        found = step.dispatcher.routes[key] = _choose(key, step.dispatcher, k_cache)
    return found


def _choose(key: tuple, dispatcher: Dispatcher, k_cache: torch.Tensor) -> tuple:
    phase, dtype, device_type, num_heads, head_dim, num_kv_heads, block_size, scaling, sliding_window, softcap = key
    call = AttentionCall(phase=phase, device_type=device_type, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, block_size=block_size, sliding_window=sliding_window,
                         softcap=softcap, kv_dtype=None if k_cache.dtype == dtype else k_cache.dtype)
    params = AttentionParams(scale=head_dim**-0.5 if scaling is None else scaling, sliding_window=sliding_window,
                             softcap=softcap)
    return dispatcher.select(call), dispatcher.writer(k_cache), params


def choose_decode_routes(step: PagedStep) -> None:
    """Before a decode forward that may be compiled: choose the decode backend of every layer shape an eager forward
    has met, so that compiled layers only look their route up (choosing runs host code a compiler cannot trace)."""
    routes = step.dispatcher.routes
    if step.metadata.phase is Phase.DECODE:
        for key in [k for k in routes if k[0] is not Phase.DECODE and (Phase.DECODE, *k[1:]) not in routes]:
            routes[(Phase.DECODE, *key[1:])] = _choose((Phase.DECODE, *key[1:]), step.dispatcher,
                                                       step.pool.kv_caches[0][0])
