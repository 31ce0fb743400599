"""The router replicas' admission queues as this prefill worker last heard them.

Every health probe a router replica sends carries a :class:`~kvruntime.messages.prefill.QueueReport`
(its requests admitted and not yet at their first token); the worker keeps the latest per replica
and answers each probe with all the fresh ones, so every replica learns the others' queues
(``cluster.control.peers``) one health period late at most. A replica about to admit a request
exchanges its report with one worker at once (``cluster.control.exchange``): the worker records it
and answers under one lock, so of two replicas admitting at the same moment the second sees the
first's request. Reports travel on several paths (the probe, the exchange, a correction sent
without waiting), so each carries the replica's counter and an older one never replaces a newer.
"""
from __future__ import annotations

import threading
import time

from kvruntime.messages.prefill import REPORT_TTL_S, QueueReport


class QueueReports:
    """Held by each prefill worker: the latest queue report of every replica (thread-safe)."""

    def __init__(self, ttl_s: float = REPORT_TTL_S, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._reports: dict[str, tuple[QueueReport, float]] = {}    # replica -> (its newest report, heard at)
        self._lock = threading.Lock()

    def update(self, report: QueueReport | None) -> dict[str, QueueReport]:
        """Record ``report`` (None: a probe without one) and return every fresh report, by replica."""
        now = self.clock()
        with self._lock:
            if report is not None:
                held = self._reports.get(report.replica)
                if held is None or report.seq >= held[0].seq:
                    self._reports[report.replica] = (report, now)
            for r in [r for r, (_, t) in self._reports.items() if now - t > self.ttl_s]:
                del self._reports[r]
            return {r: rep for r, (rep, _) in self._reports.items()}
