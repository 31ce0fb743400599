"""Errors a caller can cause, mapped to HTTP status codes and OpenAI-shaped error JSON.

Every error body is ``{"error": {"message", "type", "param", "code", "request_id"}}``; the Serve
proxy returns the same id in ``x-request-id``; anything that is not the caller's mistake is a
500 whose message holds only that id (the details are logged under it)."""
from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from cluster.control.errors import RequestError

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"


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
