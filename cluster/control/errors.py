"""The caller's mistakes as a value: :class:`RequestError` carries an HTTP 4xx status, a message that
says what to fix and the OpenAI error shape. The control plane raises it (an unknown chunk, a bad
template, a deadline); the HTTP edge (``cluster.http.errors``) turns it into a response."""
from __future__ import annotations

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class RequestError(Exception):
    """The caller's mistake (``status`` a 4xx code; ``message`` says what to fix) or a condition of
    the server the caller can act on (a 5xx: typed ``server_error``, 503 ``service_unavailable``,
    never ``invalid_request_error``). ``retry_after``: seconds for the ``Retry-After`` header."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after

    def to_json(self, request_id: str | None = None) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code,
                          "request_id": request_id}}
