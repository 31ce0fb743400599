"""Errors a caller can cause, mapped to HTTP status codes and OpenAI-style error JSON."""
from __future__ import annotations


class RequestError(Exception):
    """The caller's mistake: ``status`` is a 4xx code; ``message`` says what to fix."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def to_json(self) -> dict:
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
