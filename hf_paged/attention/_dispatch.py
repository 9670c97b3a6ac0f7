"""Pick the backend that serves each (phase, layer shape) in the order flash -> cuda -> torch, and the attention calls
a model's config implies, so that backends can be chosen (and refused) before the first step.

The choice is made once per distinct :class:`AttentionCall` and memoised, so a layer pays a dict lookup. A user
may restrict the choice (``PagedAttentionCache(..., backend="torch")``, ``backend=("cuda", "torch")`` or the
``HF_PAGED_BACKEND`` variable, comma-separated): only the named backends are tried, in the order given, and a call
none of them can serve raises instead of silently falling back.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import pkgutil
from collections.abc import Sequence

import torch

from hf_paged import envs
from hf_paged.cache._config import backend_names
from hf_paged.attention import backends as _backends_pkg
from hf_paged.attention.backends.base import AttentionBackend, AttentionCall, backend_named, registered_backends
from hf_paged.attention._metadata import Phase
from hf_paged.cache._kv_pool import KVLayout

logger = logging.getLogger("hf_paged")


def _import_backends() -> None:
    for mod in pkgutil.iter_modules(_backends_pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"{_backends_pkg.__name__}.{mod.name}")


def available_backends() -> list[str]:
    """Names of the registered backends, in the default dispatch order."""
    _import_backends()
    return [b.name for b in registered_backends()]


class Dispatcher:
    """Chooses backends and records which one served each phase (``served``: phase name -> backend name)."""

    def __init__(self, backend: str | Sequence[str] | None = None):
        _import_backends()
        self.allowed = backend_names(backend or envs.backend())
        self._order = registered_backends() if self.allowed is None else [backend_named(n) for n in self.allowed]
        self.served: dict[str, str] = {}
        self._choice: dict[AttentionCall, AttentionBackend] = {}
        self._writer: dict[tuple, AttentionBackend] = {}
        # The attention function's memo: (phase, layer shape, scalars) -> (backend, KV writer, params).
        self.routes: dict[tuple, tuple] = {}

    def select(self, call: AttentionCall) -> AttentionBackend:
        backend = self._chosen(call)
        self.served[call.phase.value] = backend.name
        return backend

    def _chosen(self, call: AttentionCall) -> AttentionBackend:
        """The backend serving ``call``: the first allowed one that can, chosen once (raises ``NotImplementedError``
        with each backend's reason where none can)."""
        if call in self._choice:
            return self._choice[call]
        reasons = []
        for backend in self._order:
            reason = backend.unsupported_reason(call)
            if reason is None:
                logger.debug("hf_paged: %s attention served by the %s backend (%s)", call.phase.value, backend.name,
                             call)
                self._choice[call] = backend
                return backend
            reasons.append(f"{backend.name}: {reason}")
        hint = "" if self.allowed is None else f". Allow more backends (now {list(self.allowed)}) to let another serve."
        raise NotImplementedError(f"no attention backend can serve {call}: " + "; ".join(reasons) + hint)

    def check_restriction(self, calls: list[AttentionCall]) -> None:
        """With backends restricted by the user, raise ``NotImplementedError`` now (naming the backends and what to
        allow) when none of them can serve one of ``calls``, rather than at the first forward."""
        if self.allowed is not None:
            for call in calls:
                self._chosen(call)

    def writer(self, k_cache: torch.Tensor) -> AttentionBackend:
        """The backend whose KV write serves this cache tensor: the first allowed one with a write of its own,
        else the first registered one that has one (the torch backend always does)."""
        backend = self._writer_for((k_cache.device.type, k_cache.dtype, k_cache.shape[-1]))
        self.served["write"] = backend.name
        return backend

    def _writer_for(self, key: tuple) -> AttentionBackend:
        if key not in self._writer:
            candidates = (*self._order, *registered_backends())
            self._writer[key] = next(b for b in candidates if b.write_unsupported_reason(*key) is None)
        return self._writer[key]

    def capture_unsupported_reason(self, calls: list[AttentionCall], dtype: torch.dtype) -> str | None:
        """Before any step: None if the backends that will serve the decode ``calls`` and the KV write of such a
        cache may be captured in a CUDA graph, else why not (chooses them now, as the first step would)."""
        try:
            chosen = [(call, self._chosen(call)) for call in calls]
        except NotImplementedError as err:
            return str(err)
        return _capture_reason(chosen, [self._writer_for((c.device_type, dtype, c.head_dim)) for c in calls])

    def graph_unsupported_reason(self) -> str | None:
        """After an eager decode step: None if every decode call and KV write it chose may be captured in a CUDA
        graph, else why not (a backend named, with what to change)."""
        decode = [(c, b) for c, b in self._choice.items() if c.phase is Phase.DECODE]
        return _capture_reason(decode, self._writer.values()) if decode else "no decode step has run yet"


def _capture_reason(chosen: list[tuple[AttentionCall, AttentionBackend]], writers) -> str | None:
    """None if each ``(call, backend)`` of ``chosen`` and each KV writer of ``writers`` may be captured in a CUDA
    graph, else the first reason why not."""
    calls = (f"{reason} ({call})" for call, backend in chosen
             if (reason := backend.graph_unsupported_reason(call)) is not None)
    writes = (f"the {w.name} backend's KV write is not capture-safe" for w in writers if not w.capture_safe_write)
    return next(itertools.chain(calls, writes), None)


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
