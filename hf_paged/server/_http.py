"""``HeaderTimeoutH11``: uvicorn's HTTP/1.1 protocol with a deadline on the request line and headers.

uvicorn times a connection out only between requests (``timeout_keep_alive``, armed after a response); a client that
opens a connection and sends its headers slowly, or not at all, holds it for ever (slowloris). This protocol closes
a connection whose request line and headers are not complete ``header_timeout`` seconds after the connection opened
or the response before was sent. (The body's deadline is the app's: :mod:`hf_paged.server._access`.)
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11(H11Protocol):
    header_timeout: float = 30.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline while the client owes a request's headers (h11: its state is IDLE), drop it once they
        are in."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self.transport.close)
        elif not waiting and self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11]:
    """The protocol class to pass as uvicorn's ``http=``, with ``seconds`` of deadline."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout": seconds})
