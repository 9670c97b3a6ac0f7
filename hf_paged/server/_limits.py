"""``RequestLimits``: ASGI middleware bounding what a client may make the server read.

A body larger than ``max_body_bytes`` is refused with a 413: at once when its ``Content-Length`` says so (nothing of
it is read), or as soon as a chunked body passes the limit. A client that sends its body slower than one message
every ``read_timeout`` seconds, or whose body is not complete ``body_timeout`` seconds after its headers (one that
trickles a byte now and then), gets a 408: a slow client must not hold a connection and a request's memory for
ever. The waits are on the body only, never on a response being streamed.
"""

from __future__ import annotations

import asyncio

from hf_paged.server._errors import ServerError, send_error

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 300.0


class RequestLimits:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.read_timeout, self.body_timeout = read_timeout, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await send_error(send, ServerError(400, "the Content-Length header is not a number"),
                                    ((b"connection", b"close"),))
        if declared is not None and int(declared) > self.max_body_bytes:
            return await send_error(send, self._too_large(int(declared)), ((b"connection", b"close"),))
        return await self.app(scope, self._bounded(receive), send)

    def _too_large(self, size: int | None) -> ServerError:
        got = f"{size} bytes" if size is not None else "more"
        return ServerError(413, f"the body has {got}; this server takes at most {self.max_body_bytes} "
                                "(--max-body-bytes)", code="body_too_large")

    def _bounded(self, receive):
        read, done = 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout  # (the app is called once the headers are in)

        async def bounded_receive():
            nonlocal read, done
            if done:
                return await receive()
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), min(self.read_timeout, left))
            except asyncio.TimeoutError:
                if left < self.read_timeout:
                    raise ServerError(408, f"the body was not complete {self.body_timeout:g} s after the headers "
                                           "(--body-timeout)", code="body_timeout") from None
                raise ServerError(408, f"the client sent no part of the body for {self.read_timeout:g} s "
                                       "(--read-timeout)", code="read_timeout") from None
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise self._too_large(None)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return bounded_receive
