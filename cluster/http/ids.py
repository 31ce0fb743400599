"""One id per request, taken at the edge and carried everywhere.

The id is the client's ``x-request-id`` header when it is well-formed (1 to 128 characters of
``A-Z a-z 0-9 . _ : -``); otherwise one is drawn, once: the Ray Serve proxy's own (it draws a
uuid4 for a request that sent no header, and logs under it) or, outside Serve or after a
malformed header, a uuid4 in hex. The same id is then the router's ``plan.request_id`` and
``explain.request_id``, the prefix of every transfer id, the request id of every message sent
to prefill and decode actors, the ``request_id=`` on every log line of the request in each of
those processes (``kvruntime.request_log``), ``error.request_id`` of an error body, the
response body's ``id`` after the object's prefix (``chatcmpl-<id>``, ``cmpl-<id>``,
``notes-<id>``) and the response's ``x-request-id`` header.

The Serve proxy echoes the request's header in the response itself; this module says when the
ingress must set it instead (no proxy, or a malformed header replaced: the client then sees the
proxy's echo of what it sent beside the id the server used).
"""
from __future__ import annotations

import re
import uuid

REQUEST_ID_HEADER = "x-request-id"
_WELL_FORMED = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def well_formed(value: str | None) -> bool:
    return isinstance(value, str) and _WELL_FORMED.fullmatch(value) is not None


def _serve_request_id() -> str:
    """The Serve proxy's id of the request being served ("" outside a Serve replica)."""
    try:
        from ray import serve
        return serve.context._get_serve_request_context().request_id or ""
    except Exception:                # outside a Serve replica
        return ""


def request_id(headers) -> tuple[str, bool]:
    """(this request's id, whether the response's ``x-request-id`` header is to be set here)."""
    given = headers.get(REQUEST_ID_HEADER)
    serve_id = _serve_request_id()
    if well_formed(given):
        return given, serve_id != given            # the proxy echoes the header it was sent
    if given is None and well_formed(serve_id):
        return serve_id, False                     # the proxy drew it and returns it
    return uuid.uuid4().hex, True
