"""One request id in every log line of that request, in every process it crosses.

The router takes the id at the edge (``cluster.http.ids``) and binds it for the request;
prefill and decode actors bind the id each call carries (``RequestPlan.request_id``, the
``request_id`` of ``DecodeWorker.generate``) for the call's duration. :func:`install` puts a
log record factory in the process: every record gets a ``kvnotes_request_id`` attribute (``"-"``
outside a request; not ``request_id``, which Ray Serve passes in ``extra`` of its access log lines:
``logging`` refuses an ``extra`` key the record already has, and that KeyError failed every request
in the replica after its response, with a traceback in the proxy's log), and the message of a record made inside a request ends with
``request_id=<id>``, whatever the handler's format (Ray's worker and Serve replica log files
included), so ``grep request_id=<id>`` over the router's, the prefill actors' and the decode
actors' logs finds that one request. Pure standard library: every box may import it.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from typing import Iterator

#: the id of the request this code runs for (None outside one)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvnotes_request_id", default=None)
_installed = False
PACKAGES = ("cluster", "decode_workers", "prefill_workers", "kvruntime", "kvtransport")


def current() -> str | None:
    return REQUEST_ID.get()


@contextlib.contextmanager
def bound(request_id: str | None) -> Iterator[None]:
    """Log records made inside the block carry ``request_id`` (nothing changes for None)."""
    if not request_id:
        yield
        return
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        try:
            REQUEST_ID.reset(token)
        except ValueError:           # a generator closed from another context (garbage collected elsewhere)
            REQUEST_ID.set(None)


def install(*, worker: bool = False) -> None:
    """Tag this process' log records with the bound request id (idempotent). ``worker``: in a Ray
    actor or Serve replica process whose root logger has no handler, one goes on stderr (Ray
    writes it to the process' ``worker-*.err`` file), formatted like ``kvnotes`` on the command
    line, and kvnotes' own packages log at ``KVNOTES_LOG`` (INFO by default; other libraries stay
    at warnings). Without it only warnings would reach the file, with neither time nor logger."""
    global _installed
    root = logging.getLogger()
    if worker and not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
        for pkg in PACKAGES:
            logging.getLogger(pkg).setLevel(os.environ.get("KVNOTES_LOG", "INFO"))
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        rid = REQUEST_ID.get()
        record.kvnotes_request_id = rid or "-"
        if rid:
            try:
                msg = record.getMessage()
            except Exception:            # a malformed call: logging reports it as usual, untagged
                return record
            tag = f"request_id={rid}"
            if tag not in msg:
                record.msg, record.args = f"{msg} {tag}", None
        return record

    logging.setLogRecordFactory(factory)
