"""``ServerError``: a refusal with OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

#: OpenAI's ``type`` for each status the server answers with; any other status (400, 401, 405, 413, 499) is an
#: ``invalid_request_error``.
ERROR_TYPES = {403: "permission_error", 404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "service_unavailable_error"}


class ServerError(Exception):
    """An answer other than 200: ``status`` and a one-line ``message`` saying what to send instead; ``param`` names
    the request field at fault, ``code`` is a short machine-readable reason (both may be None)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServerError:
    return ServerError(400, message, param, code)

