"""``AccessCheck``: ASGI middleware deciding who may use the API.

- ``api_key``: every route needs ``Authorization: Bearer <key>`` (a 401 in OpenAI's shape otherwise): the ``/v1``
  routes, the API's description (``/docs``, ``/redoc``, ``/openapi.json``) and unknown paths alike; only ``/health``
  and ``/metrics`` stay open, for probes and scrapers.
- ``allowed_hosts``: the ``Host`` header a request may carry (any port). A server bound to loopback without a key
  takes only loopback names by default: a web page the user visits can make the browser resolve its own name to
  127.0.0.1 (DNS rebinding) and post to the server, but cannot make the browser send another ``Host``. None: any.
"""

from __future__ import annotations

import hmac
import ipaddress

from hf_paged.server._errors import ServerError, send_error

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AccessCheck:
    def __init__(self, app, api_key: str | None = None, allowed_hosts: tuple[str, ...] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = None if allowed_hosts is None or "*" in allowed_hosts else {
            h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host and host not in self.allowed_hosts:
                return await send_error(send, ServerError(
                    403, f"the Host header {host!r} is not allowed here: this server answers requests addressed "
                         f"to {', '.join(sorted(self.allowed_hosts))} (--allowed-hosts, or --api-key)",
                    code="host_not_allowed"))
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return await send_error(send, ServerError(
                    401, "missing or wrong API key; send it as the header 'Authorization: Bearer <key>' (the "
                         "openai client's api_key)", code="invalid_api_key"),
                    ((b"www-authenticate", b"Bearer"),))
        return await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """``Host`` without its port, lower case, IPv6 brackets removed."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
