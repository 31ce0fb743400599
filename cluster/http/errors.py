"""Errors a caller can cause, mapped to HTTP status codes and OpenAI-shaped error JSON.

Every error body is ``{"error": {"message", "type", "param", "code", "request_id"}}``: the
request's one id (``cluster.http.ids``), also in the response's ``x-request-id``; a state store that does not answer is a 503
``state_store_unavailable`` with ``Retry-After``; anything else that is not the caller's mistake
is a 500 whose message holds only that id (the details are logged under it)."""
from __future__ import annotations

import logging
import math

from starlette.responses import JSONResponse

from cluster.control.errors import RequestError
from cluster.control.state import StateStoreUnavailable

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2        # a state store outage: each replica probes the store every state_probe_s (1 s default)


def internal_error_json(request_id: str | None) -> dict:
    return {"error": {"message": f"internal error; the server log has the details under request id {request_id}",
                      "type": "server_error", "param": None, "code": None, "request_id": request_id}}


def state_unavailable_json(request_id: str | None) -> dict:
    return {"error": {"message": "the state store is unavailable (it holds keys, registrations and sessions); "
                                 f"retry after {RETRY_AFTER_S} s",
                      "type": "server_error", "param": None, "code": "state_store_unavailable",
                      "request_id": request_id}}


def error_response(exc: BaseException, request_id: str | None) -> JSONResponse:
    """The response for ``exc``: its 4xx for a :class:`RequestError`, 503 with ``Retry-After``
    while the state store does not answer, else a logged 500."""
    if isinstance(exc, RequestError):
        r = JSONResponse(exc.to_json(request_id), status_code=exc.status)
    elif isinstance(exc, StateStoreUnavailable):
        log.warning("request %s: %s", request_id, exc)
        r = JSONResponse(state_unavailable_json(request_id), status_code=503,
                         headers={"retry-after": str(RETRY_AFTER_S)})
    else:
        log.error("request %s: internal error", request_id, exc_info=exc)
        r = JSONResponse(internal_error_json(request_id), status_code=500)
    if isinstance(exc, RequestError) and exc.retry_after is not None:
        r.headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, RequestError) and exc.status == 401:
        r.headers["www-authenticate"] = "Bearer"
    return r
