"""The garbage collector during a call's device work: the objects that exist when the call starts are set aside.

Python's cyclic collector walks every tracked object in a full (oldest-generation) collection. After a model is
compiled a process holds about 0.5-0.6 million of them (the model, transformers, dynamo's and inductor's caches),
and a full collection takes 0.3-0.5 s, during which the host launches nothing and the device idles. The compile
leaves many new long-lived objects behind, which makes the next full collection due soon: measured on an H200, it
fell inside the first anchor call after a warm-up and took 0.34 s of its 1.93 s. It falls at the first burst of
allocations after the compiling call, so the freeze covers a call from its first line (the prompts' checks
included).

:func:`frozen_heap` moves every object that exists at its start into the collector's permanent generation
(``gc.freeze()``, constant time) and back at its end (``gc.unfreeze()``), so a collection inside the call walks only
what the call made; garbage the call makes is collected as usual, and what was set aside is collected as usual
after the call. Nested and concurrent calls share one freeze (the first in freezes, the last out unfreezes). Where
the collector is off, or the process froze objects of its own (a server that calls ``gc.freeze()`` after start, as
``hf-paged serve`` does), it changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["frozen_heap"]

_lock = threading.Lock()
_holders = 0
_froze = False  # whether the first holder froze (and the last one must unfreeze)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Set aside, for the ``with`` block (or each call of a function decorated with ``@frozen_heap()``), every
    object the collector tracks at its start (see the module)."""
    global _holders, _froze
    with _lock:
        if _holders == 0:
            # get_freeze_count() walks the permanent generation: constant time while it is empty, as it is unless
            # someone froze objects of their own, whose freeze is then left as it is
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _froze:
                gc.unfreeze()
                _froze = False
