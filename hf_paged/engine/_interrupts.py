"""``InterruptGuard``: Ctrl-C waits until the engine's state is consistent again.

A step's bookkeeping (scheduling, committing, writing sampled tokens into sequences, stop checks) must run whole:
a ``KeyboardInterrupt`` between two of its lines could leave a request holding a placeholder forever, or running
past ``max_new_tokens``. While the guard is held, SIGINT is only recorded, and raised when the guard is left; the
device work in between (:meth:`InterruptGuard.allowed`) stays interruptible, since the engine can drop a step that
did not run. Signals reach only the main thread, so elsewhere, or when the program installed its own SIGINT
handler, the guard does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class InterruptGuard:
    def __init__(self) -> None:
        self._held = False
        self._pending = False
        self._interruptible = False  # inside allowed(): a SIGINT raises at once

    def _record(self, signum, frame) -> None:
        if self._interruptible:
            raise KeyboardInterrupt
        self._pending = True

    @contextmanager
    def held(self) -> Iterator[None]:
        """Defer SIGINT for the block; a Ctrl-C received meanwhile is raised as ``KeyboardInterrupt`` on leaving."""
        if (self._held or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        signal.signal(signal.SIGINT, self._record)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.raise_pending()

    def raise_pending(self) -> None:
        """Raise a Ctrl-C recorded so far (at a point where the state is consistent)."""
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """Inside :meth:`held`: let SIGINT interrupt this block (the caller undoes what the block began)."""
        if not self._held:
            yield
            return
        self.raise_pending()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False
