"""Pick the backend that serves each (phase, layer shape) in the order flash -> cuda -> torch.

The choice is made once per distinct :class:`AttentionCall` and memoised, so a layer pays a dict lookup. A user
may pin a backend by name (``PagedAttentionCache(..., backend="torch")`` or ``HF_PAGED_BACKEND``); a pinned
backend that cannot serve a call raises instead of silently falling back.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil

import torch

from hf_paged.attention import backends as _backends_pkg
from hf_paged.attention.backends.base import AttentionBackend, AttentionCall, registered_backends

logger = logging.getLogger("hf_paged")


def _import_backends() -> None:
    for mod in pkgutil.iter_modules(_backends_pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"{_backends_pkg.__name__}.{mod.name}")


def available_backends() -> list[str]:
    _import_backends()
    return [b.name for b in registered_backends()]


class Dispatcher:
    """Chooses backends and records which one served each phase (``served``: phase name -> backend name)."""

    def __init__(self, pinned: str | None = None):
        _import_backends()
        pinned = pinned or os.environ.get("HF_PAGED_BACKEND") or None
        names = [b.name for b in registered_backends()]
        if pinned is not None and pinned not in names:
            raise ValueError(f"unknown attention backend {pinned!r}; choose one of {names}")
        self.pinned = pinned
        self.served: dict[str, str] = {}
        self._choice: dict[AttentionCall, AttentionBackend] = {}
        self._writer: dict[tuple, AttentionBackend] = {}

    def select(self, call: AttentionCall) -> AttentionBackend:
        backend = self._choice.get(call)
        if backend is None:
            backend = self._choose(call)
            self._choice[call] = backend
            logger.debug("hf_paged: %s attention served by the %s backend (%s)", call.phase.value, backend.name, call)
        self.served[call.phase.value] = backend.name
        return backend

    def writer(self, k_cache: torch.Tensor) -> AttentionBackend:
        """The backend whose KV-write serves this cache tensor: the pinned one if it has a write of its own, else
        the first in order that does (the torch backend always does)."""
        key = (k_cache.device.type, k_cache.dtype, k_cache.shape[-1])
        backend = self._writer.get(key)
        if backend is None:
            order = registered_backends()
            if self.pinned is not None:
                order = sorted(order, key=lambda b: b.name != self.pinned)
            backend = next(b for b in order if b.write_unsupported_reason(*key) is None)
            self._writer[key] = backend
        self.served["write"] = backend.name
        return backend

    def _choose(self, call: AttentionCall) -> AttentionBackend:
        reasons = []
        for backend in registered_backends():
            if self.pinned is not None and backend.name != self.pinned:
                continue
            reason = backend.unsupported_reason(call)
            if reason is None:
                return backend
            reasons.append(f"{backend.name}: {reason}")
        raise NotImplementedError(
            f"no attention backend can serve {call}: " + "; ".join(reasons)
            + ("" if self.pinned is None else f". Unpin the backend (pinned: {self.pinned!r}) to let another serve.")
        )
