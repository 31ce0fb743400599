"""The request body at the HTTP edge: its size (413, from ``RequestLimits.max_body_bytes``) and
nesting, read and parsed without blocking the event loop (a large body is parsed in a worker
thread); requests in flight per tenant (429). Field checks are in ``cluster.http.validate``."""
from __future__ import annotations

import json
import threading

import anyio

from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits

_THREAD_PARSE_BYTES = 64 << 10      # bodies larger than this are parsed off the event loop
_MAX_DEPTH = 32                     # nesting of objects / arrays in a request body


def parse_json(raw: bytes):
    """The JSON object in ``raw``; 400 for invalid UTF-8 or JSON, integers past 4300 digits,
    nesting deeper than 32, lone surrogates in strings, or a body that is not an object."""
    if not raw:
        raise RequestError(400, "empty request body: send a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                                f"{exc.colno}") from None
    except RecursionError:
        raise RequestError(400, f"request body is nested too deeply (at most {_MAX_DEPTH} levels)") from None
    except ValueError as exc:          # e.g. an integer literal longer than Python's digit limit
        raise RequestError(400, f"request body has an unreadable value: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, not {type(body).__name__}")
    _check_tree(body)
    return body


def _check_tree(body) -> None:
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise RequestError(400, f"request body is nested too deeply (at most {_MAX_DEPTH} levels)")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_str(k)
                stack.append((x, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, str):
            _check_str(v)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, "request body holds a string with an unpaired UTF-16 surrogate") from None


async def read_json(request, limits: RequestLimits):
    """Read and parse the body of a Starlette ``request`` within ``limits.max_body_bytes``."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise RequestError(415, f"content-type must be application/json, got {media!r}", param="content-type")
    declared = request.headers.get("content-length")
    too_big = RequestError(413, f"request body is larger than this server's limit of {limits.max_body_bytes} bytes")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limits.max_body_bytes:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > _THREAD_PARSE_BYTES:
        return await anyio.to_thread.run_sync(parse_json, raw)
    return parse_json(raw)


class InflightLimiter:
    """At most ``limit`` requests in flight per tenant (in this router replica); the next is a 429."""

    def __init__(self, limit: int, on_reject=None):
        self.limit, self.on_reject = limit, on_reject
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> None:
        with self._lock:
            n = self._n.get(tenant, 0)
            if n >= self.limit:
                if self.on_reject:
                    self.on_reject(tenant)
                raise RequestError(429, f"too many requests in flight for this tenant (limit {self.limit}); "
                                        "retry when one finishes", code="rate_limit_exceeded", retry_after=1.0)
            self._n[tenant] = n + 1

    def release(self, tenant: str) -> None:
        with self._lock:
            n = self._n.get(tenant, 0) - 1
            if n > 0:
                self._n[tenant] = n
            else:
                self._n.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._n.get(tenant, 0)
