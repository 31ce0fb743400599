"""The registrations' last use and tier status, written after a request's first event, off the
time to first token (the router's bookkeeping for listings and the ``kvnotes_registered_chunks``
gauges; a listing looks the tier up again, so a lost mark costs nothing but a stale field)."""
from __future__ import annotations

import asyncio
import logging

from cluster.control.metrics import Metrics
from cluster.control.state import StateStore

log = logging.getLogger(__name__)


class UsageMarks:
    def __init__(self, state: StateStore, metrics: Metrics):
        self.state, self.metrics = state, metrics
        self._background: set = set()     # writes in flight (referenced until done)

    def later(self, tenant: str, marks: list[tuple[str, str, bool]], now: float) -> None:
        """Write ``marks`` (kind, name, in the tier) in a worker thread, once the request's first
        event is out (or it ended without one): one state-store transaction per registration. A
        failed write is logged and counted (``kvnotes_fallbacks_total{reason="mark_used_failed"}``);
        the request goes on."""
        if not marks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:     # a generator closed outside the event loop: written here
            loop = None
        if loop is None:
            try:
                self._write(tenant, marks, now)
            except Exception as exc:
                self._failed(exc)
            return
        fut = loop.run_in_executor(None, self._write, tenant, marks, now)
        self._background.add(fut)
        fut.add_done_callback(self._done)

    def _write(self, tenant: str, marks: list[tuple[str, str, bool]], now: float) -> None:
        for kind, name, in_tier in marks:
            self.state.mark_used(tenant, kind, name, now, in_tier)

    def _done(self, fut) -> None:
        self._background.discard(fut)
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.metrics.record_fallback("mark_used_failed")
        log.warning("recording the registrations' last use failed: %s", exc)
