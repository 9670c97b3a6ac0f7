"""The context of a model call that hf_paged makes itself: an engine step, or a decode step it captures in a CUDA graph.

Such a call passes nothing but token ids and positions to the model; what the code inside the model needs beyond
them is set here for the duration of the call (vLLM's ``set_forward_context`` does the same):

- ``step``: the forward's :class:`~hf_paged.attention.PagedStep` (metadata, KV pool, backends), which the
  ``"hf_paged"`` attention function reads (and the mask function, which then builds no mask);
- ``local_logits``: a tensor-parallel ``lm_head`` returns this rank's vocabulary columns (``hf_paged.parallel``);
- ``skinny_linears``: the linear layers patched by ``hf_paged.compile`` run on the skinny decode kernel.

``step`` and ``local_logits`` are read in eager code only and belong to the calling thread. ``skinny_linears`` and
whether one of hf_paged's own calls is running (:func:`in_own_call`) are read inside compiled code, whose compiler
guards on plain attributes (not on thread-local ones), so they are one value for the process: graphs traced inside
such a call hold what it asks for, the others do not. (So a plain forward of the same model in another thread,
while an engine steps, is not served.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _ThreadState(threading.local):
    step: Any = None
    local_logits: bool = False


class _ProcessState:
    __slots__ = ("skinny_linears", "own_call")

    def __init__(self) -> None:
        self.skinny_linears = False
        self.own_call = False


_thread = _ThreadState()
_process = _ProcessState()


@contextmanager
def forward_context(step: Any = None, *, skinny_linears: bool = False, local_logits: bool = False) -> Iterator[None]:
    """Set the context of one model call (see the module docstring); the previous one is back afterwards."""
    saved = (_thread.step, _thread.local_logits, _process.skinny_linears, _process.own_call)
    _thread.step, _thread.local_logits = step, local_logits
    _process.skinny_linears, _process.own_call = skinny_linears, step is not None
    try:
        yield
    finally:
        _thread.step, _thread.local_logits, _process.skinny_linears, _process.own_call = saved


def current_step() -> Any:
    """The paged step of the model call in progress in this thread, or None outside hf_paged's own calls."""
    return _thread.step


def local_logits() -> bool:
    return _thread.local_logits


def skinny_linears() -> bool:
    return _process.skinny_linears


def in_own_call() -> bool:
    """Whether one of hf_paged's own model calls (a step in the context) is running."""
    return _process.own_call
