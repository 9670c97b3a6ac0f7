"""``Door``: ASGI middleware deciding who may use the API and how much of a body it may make the server read.

- ``api_key``: every route needs ``Authorization: Bearer <key>`` (a 401 in OpenAI's shape otherwise): the ``/v1``
  routes, the API's description (``/docs``, ``/redoc``, ``/openapi.json``) and unknown paths alike; only ``/health``
  and ``/metrics`` stay open, for probes and scrapers.
- ``allowed_hosts``: the ``Host`` header a request may carry (any port). A server bound to loopback without a key
  takes only loopback names by default: a web page the user visits can make the browser resolve its own name to
  127.0.0.1 (DNS rebinding) and post to the server, but cannot make the browser send another ``Host``. None: any.
- ``limits`` (:class:`~hf_paged.server._limits.Limits`): a body larger than ``max_body_bytes`` is refused with a 413:
  at once when its ``Content-Length`` says so (nothing of it is read), or as soon as a chunked body passes the limit.
  A client that sends its body slower than one message every ``read_timeout`` seconds, or whose body is not complete
  ``body_timeout`` seconds after its headers (one that trickles a byte now and then), gets a 408: a slow client must
  not hold a connection and a request's memory for ever. The waits are on the body only, never on a response being
  streamed.

``answer(error)`` is the response that says a ``ServerError``, the door's and the app's error handlers' alike.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from starlette.responses import JSONResponse

from hf_paged.server._errors import ServerError
from hf_paged.server._limits import Limits

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


def answer(error: ServerError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The response that says ``error``, in OpenAI's shape: the door's, and the app's error handlers'."""
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Door:
    def __init__(self, app, limits: Limits, api_key: str | None = None, allowed_hosts: tuple[str, ...] | None = None):
        self.app, self.limits = app, limits
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = None if allowed_hosts is None or "*" in allowed_hosts else {
            h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (refusal := self._refusal(dict(scope["headers"]), scope["path"])) is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, self._bounded(receive), send)

    def _refusal(self, headers: dict[bytes, bytes], path: str) -> JSONResponse | None:
        """The answer to a request turned away before its body is read (None: it may come in)."""
        host = _host_name(headers.get(b"host", b"").decode("latin-1"))
        if self.allowed_hosts is not None and host and host not in self.allowed_hosts:
            return answer(ServerError(403, f"the Host header {host!r} is not allowed here: this server answers "
                                      f"requests addressed to {', '.join(sorted(self.allowed_hosts))} "
                                      "(--allowed-hosts, or --api-key)", code="host_not_allowed"))
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return answer(ServerError(401, "missing or wrong API key; send it as the header 'Authorization: "
                                          "Bearer <key>' (the openai client's api_key)", code="invalid_api_key"),
                              {"www-authenticate": "Bearer"})
        if (declared := headers.get(b"content-length")) is not None and not declared.isdigit():
            return answer(ServerError(400, "the Content-Length header is not a number"), {"connection": "close"})
        if declared is not None and int(declared) > self.limits.max_body_bytes:
            return answer(self._too_large(int(declared)), {"connection": "close"})
        return None

    def _too_large(self, size: int | None) -> ServerError:
        got = f"{size} bytes" if size is not None else "more"
        return ServerError(413, f"the body has {got}; this server takes at most {self.limits.max_body_bytes} "
                                "(--max-body-bytes)", code="body_too_large")

    def _bounded(self, receive):
        limits, read, done = self.limits, 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout  # (the app is called once the headers are in)

        async def bounded_receive():
            nonlocal read, done
            if done:
                return await receive()
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), min(limits.read_timeout, left))
            except asyncio.TimeoutError:
                if left < limits.read_timeout:
                    raise ServerError(408, f"the body was not complete {limits.body_timeout:g} s after the headers "
                                           "(--body-timeout)", code="body_timeout") from None
                raise ServerError(408, f"the client sent no part of the body for {limits.read_timeout:g} s "
                                       "(--read-timeout)", code="read_timeout") from None
            read += len(message.get("body", b""))  # (a disconnect has no body, and ends the request's messages)
            if read > limits.max_body_bytes:
                raise self._too_large(None)
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return bounded_receive


def _host_name(host: str) -> str:
    """``Host`` without its port, lower case, IPv6 brackets removed."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
