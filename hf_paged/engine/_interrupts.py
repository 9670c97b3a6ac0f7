"""``InterruptGuard``: signals' handlers wait until the engine's state is consistent and its lock free again.

A step's bookkeeping (scheduling, committing, writing sampled tokens into sequences, stop checks) must run whole:
a ``KeyboardInterrupt`` between two of its lines could leave a request holding a placeholder forever, return the
placeholder as a token, or run a request past ``max_new_tokens``. Such exceptions come from signal handlers, which
Python runs between any two lines of the main thread: the default SIGINT handler, asyncio's (whose second Ctrl-C
raises), an application's own, a SIGALRM or SIGTERM handler that raises. And a handler that calls the engine
(``abort_all()`` on SIGTERM, ``stats()`` on SIGUSR1) must not run while the main thread holds the engine's lock,
which it would wait on for ever. So the engine holds its lock in the main thread only inside :meth:`held`: there
each of those signals (``_WATCHED``) that has a Python handler is only recorded, and its handler runs when the guard
is left, after the lock is released, where what it raises propagates. The device work in between (:meth:`allowed`,
run without the lock) runs whole too, and the handlers of the signals received during it run as it ends, still
without the lock: an exception raised inside torch's own Python code (between a grad-mode or inference-mode context's
entry and its exit, say) would leave that mode switched for the thread, flipped back whenever the exception's frames
are collected, and break later steps. A handler that calls the engine then holds the guard again (:meth:`held`
nested) while it holds the lock. Signals' handlers run only in the main thread, so elsewhere the guard does nothing.
"""

from __future__ import annotations

import signal
import threading

# The C functions behind signal.getsignal/signal.signal: the public ones convert every answer to an enum, which costs
# ~1 us a call; the guard reads ten handlers and sets one or two each step.
import _signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The signals whose handlers programs raise from: interrupts, termination, timers, user signals (reading every
#: signal's handler would cost ~30 us a step; these take ~3).
_WATCHED = tuple(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGBREAK")
    if hasattr(signal, name))


class InterruptGuard:
    def __init__(self) -> None:
        self._held = False
        self._saved: dict[int, Callable] = {}  # while held: the handlers in place before, by signal
        self._pending: list[tuple[Callable, int]] = []  # handlers of the signals received while held, in order

    def _defer(self, signum: int, frame) -> None:
        if (handler := self._saved.get(signum)) is not None:
            self._pending.append((handler, signum))

    @contextmanager
    def held(self) -> Iterator[None]:
        """Defer the handlers of signals received in the block; they run on leaving it (what they raise, such as a
        ``KeyboardInterrupt``, propagates from there). Nested (a handler that calls the engine), it defers them to the
        outer block's end."""
        if threading.current_thread() is not threading.main_thread() or self._held:
            yield
            return
        # the Python handlers (not SIG_DFL, SIG_IGN, or one installed from C)
        saved = {signum: handler for signum in _WATCHED if callable(handler := _signal.getsignal(signum))}
        self._saved, self._held = saved, True
        try:
            for signum in saved:
                _signal.signal(signum, self._defer)
            yield
        finally:
            self._held = False
            for signum, handler in saved.items():
                if _signal.getsignal(signum) == self._defer:
                    _signal.signal(signum, handler)
            self._saved = {}
            self.raise_pending()

    def raise_pending(self) -> None:
        """Run the handlers of the signals received so far (where the state is consistent and the engine's lock is
        not held); the first exception one of them raises propagates, after all of them ran."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        error = None
        for handler, signum in pending:
            try:
                handler(signum, None)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """Inside :meth:`held`: run the handlers of the signals received so far, then those received in this block
        as it ends (the block runs whole; what they raise propagates from its end, and the caller undoes what the
        block did). In another thread than the main one it does nothing: the handlers deferred are the main thread's,
        and run there."""
        if not self._held or threading.current_thread() is not threading.main_thread():
            yield
            return
        self.raise_pending()
        yield
        self.raise_pending()
