"""The context of a model call that hf_paged makes itself: an engine step, or a decode step it captures in a CUDA graph.

Such a call passes nothing but token ids and positions to the model; what the code inside the model needs beyond
them is set here for the duration of the call (vLLM's ``set_forward_context`` does the same), as one
:class:`ForwardContext`. Each field says whose it is. A thread's fields are read in eager code only and belong to the
calling thread. The process's fields are read inside compiled code, whose compiler guards on plain attributes (not
on thread-local ones), so they are one value for the process: graphs traced inside such a call hold what it asks
for, the others do not. (So a plain forward of the same model in another thread, while an engine steps, is not
served.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """What one of hf_paged's model calls sets for the code inside the model."""

    step: Any = None
    """The thread's: the call's :class:`~hf_paged.attention.PagedStep` (metadata, KV pool, backends), which the
    ``"hf_paged"`` attention function reads (and the mask function, which then builds no mask); None outside."""
    local_logits: bool = False
    """The thread's: a tensor-parallel ``lm_head`` returns this rank's vocabulary columns (``hf_paged.parallel``)."""
    skinny_linears: bool = False
    """The process's: the linear layers patched by ``hf_paged.compile`` run on the skinny decode kernel."""
    own_call: bool = False
    """The process's: one of hf_paged's own model calls (a step set) is running."""
    layer_kernels: bool = False
    """The process's: the code routed by ``hf_paged.compile._layer_kernels`` (norms, the residual add before the
    norm after attention, q/k/v and gate/up products, SiLU x up, the rotary embedding) runs on hf_paged's layer
    kernels; set only for calls whose layers run eagerly."""


class _ThreadContext(threading.local):
    context = ForwardContext()  # until the thread sets its own (never changed in place)


_thread = _ThreadContext()
_process = ForwardContext()  # only its process's fields are read; changed in place, so compiled code guards on them


@contextmanager
def forward_context(step: Any = None, *, skinny_linears: bool = False, local_logits: bool = False,
                    layer_kernels: bool = False) -> Iterator[None]:
    """Set the context of one model call (see the module docstring); the previous one is back afterwards."""
    saved = (_thread.context, _process.skinny_linears, _process.own_call, _process.layer_kernels)
    _thread.context = ForwardContext(step, local_logits, skinny_linears, step is not None, layer_kernels)
    _process.skinny_linears, _process.own_call, _process.layer_kernels = skinny_linears, step is not None, layer_kernels
    try:
        yield
    finally:
        _thread.context, _process.skinny_linears, _process.own_call, _process.layer_kernels = saved


def current_step() -> Any:
    """The paged step of the model call in progress in this thread, or None outside hf_paged's own calls."""
    return _thread.context.step


def local_logits() -> bool:
    return _thread.context.local_logits


def skinny_linears() -> bool:
    return _process.skinny_linears


def layer_kernels() -> bool:
    return _process.layer_kernels


def in_own_call() -> bool:
    """Whether one of hf_paged's own model calls (a step in the context) is running."""
    return _process.own_call
