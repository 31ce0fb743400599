"""Errors a caller can cause, mapped to HTTP status codes and OpenAI-shaped error JSON.

Every error body is ``{"error": {"message", "type", "param", "code", "request_id"}}``; the Serve
proxy returns the same id in ``x-request-id``; anything that is not the caller's mistake is a
500 whose message holds only that id (the details are logged under it)."""
from __future__ import annotations

import logging

from starlette.responses import JSONResponse

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
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


def internal_error_json(request_id: str | None) -> dict:
    return {"error": {"message": f"internal error; the server log has the details under request id {request_id}",
                      "type": "server_error", "param": None, "code": None, "request_id": request_id}}


def error_response(exc: BaseException, request_id: str | None) -> JSONResponse:
    """The response for ``exc``: its 4xx for a :class:`RequestError`, else a logged 500."""
    if isinstance(exc, RequestError):
        r = JSONResponse(exc.to_json(request_id), status_code=exc.status)
    else:
        log.error("request %s: internal error", request_id, exc_info=exc)
        r = JSONResponse(internal_error_json(request_id), status_code=500)
    if isinstance(exc, RequestError) and exc.status == 401:
        r.headers["www-authenticate"] = "Bearer"
    return r
