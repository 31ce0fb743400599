"""The caller's mistakes as a value: :class:`RequestError` carries an HTTP 4xx status, a message that
says what to fix and the OpenAI error shape. The control plane raises it (an unknown chunk, a bad
template, a deadline); the HTTP edge (``cluster.http.errors``) turns it into a response."""
from __future__ import annotations

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


class RequestError(Exception):
    """The caller's mistake: ``status`` is a 4xx code; ``message`` says what to fix."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def to_json(self, request_id: str | None = None) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code,
                          "request_id": request_id}}
