"""The garbage collector during a call's device work: no full collection walks the objects that existed before it.

Python's cyclic collector walks every tracked object in a full (oldest-generation) collection. After a model is
compiled a process holds about 0.5-0.6 million of them (the model, transformers, dynamo's and inductor's caches),
and a full collection takes 0.3-0.5 s, during which the host launches nothing and the device idles. The compile
leaves many new long-lived objects behind, which makes the next full collection due soon: measured on an H200, it
fell inside the first anchor call after a warm-up and took 0.34 s of its 1.93 s. It falls at the first burst of
allocations after the compiling call, so the cover starts at a call's first line (the prompts' checks included).

:func:`frozen_heap` moves every object that exists at its start into the collector's permanent generation
(``gc.freeze()``, constant time) and back at its end (``gc.unfreeze()``), so a collection inside the call walks only
what the call made; garbage the call makes is collected as usual, and what was set aside is collected as usual
after the call.

Where the process froze objects of its own (a server that calls ``gc.freeze()`` after start, as ``hf-paged serve``
does, or an interpreter that freezes a few hundred objects as it starts), an unfreeze would undo that freeze, so the
call leaves the permanent generation alone and holds off full collections instead (the oldest generation's threshold
raised for the call and put back after it, which also undoes a threshold set meanwhile): young collections run, and
garbage that outlives them waits for the first full collection after the call. On an H200 box whose Python froze
375 objects at start, a full collection of 0.37-0.53 s had fallen inside one anchor call in six to eight
(``docs/design/decisions.md`` has the A/B).

Nested and concurrent calls share one cover (the first in sets it, the last out lifts it). Where the collector is off
it changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator

_NO_FULL_COLLECTION = 1 << 30  # young collections between two full ones: none falls in a call

_lock = threading.Lock()
_holders = 0
_undo: Callable[[], None] | None = None  # what the last holder out calls


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep full collections off the objects that exist at the start of the ``with`` block (or of each call of a
    function decorated with ``@frozen_heap()``), until it ends (see the module)."""
    global _holders, _undo
    with _lock:
        if _holders == 0:
            _undo = _set_aside()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _undo is not None:
                _undo()
                _undo = None


def _set_aside() -> Callable[[], None] | None:
    """Freeze, or hold off full collections; returns what puts it back (None: the collector is off)."""
    if not gc.isenabled():
        return None
    # get_freeze_count() walks the permanent generation: constant time while it is empty, as it is unless the process
    # froze objects of its own
    if gc.get_freeze_count() == 0:
        gc.freeze()
        return gc.unfreeze
    thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds[:2], _NO_FULL_COLLECTION)
    return lambda: gc.set_threshold(*thresholds)
