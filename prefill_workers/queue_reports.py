"""The router replicas' admission queues as this prefill worker last heard them.

Every health probe a router replica sends carries a :class:`~kvruntime.messages.prefill.QueueReport`
(its requests admitted and not yet at their first token); the worker keeps the latest per replica
and answers each probe with all the fresh ones, so every replica learns the others' queues
(``cluster.control.peers``) one health period late at most.
"""
from __future__ import annotations

import threading
import time

from kvruntime.messages.prefill import REPORT_TTL_S, QueueReport


class QueueReports:
    """Held by each prefill worker: the latest queue report of every replica (thread-safe)."""

    def __init__(self, ttl_s: float = REPORT_TTL_S, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._reports: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def update(self, report: QueueReport | None) -> dict[str, int]:
        """Record ``report`` (None: a probe without one) and return every fresh report."""
        now = self.clock()
        with self._lock:
            if report is not None:
                self._reports[report.replica] = (report.queued, now)
            for r in [r for r, (_, t) in self._reports.items() if now - t > self.ttl_s]:
                del self._reports[r]
            return {r: q for r, (q, _) in self._reports.items()}
