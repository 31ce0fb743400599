"""The other router replicas' queues, as the prefill workers last heard them.

Each replica's admission queue (requests admitted, not yet at their first token) is its own; R
replicas in front of P prefill workers each see only theirs. So every health probe a replica sends
to a prefill worker carries a :class:`~kvruntime.messages.prefill.QueueReport` and the worker answers
with the reports it holds from every replica (``prefill_workers.queue_reports``, fresh ones only). The replica
keeps the latest per peer (:class:`PeerQueues`): its admission adds the others' queued requests
to its own when it predicts a first token. A report is as old as one health period at most; a
replica that stops reporting (gone, restarted under a new id) drops out after ``ttl_s``.
A report also carries the replica's unloaded TTFT (median, p90): a replica that has measured none
of its own yet (just started, or its share of the quiet requests went elsewhere) applies the TTFT
objective with the others' (:meth:`PeerQueues.reference`) instead of admitting without one.
"""
from __future__ import annotations

import threading
import time

from kvruntime.messages.prefill import REPORT_TTL_S, QueueReport


class PeerQueues:
    """Held by each router replica: the other replicas' queued requests, from its prefill workers'
    health answers (thread-safe: the health thread writes, admission reads)."""

    def __init__(self, me: str = "", ttl_s: float = REPORT_TTL_S, clock=time.monotonic):
        self.me, self.ttl_s, self.clock = me, ttl_s, clock
        self._seen: dict[str, tuple[QueueReport, float]] = {}
        self._lock = threading.Lock()

    def heard(self, reports: dict[str, QueueReport] | None) -> None:
        """One worker's answer: the replicas' reports it holds (this replica's own included)."""
        if not reports:
            return
        now = self.clock()
        with self._lock:
            for replica, report in reports.items():
                if replica != self.me:
                    self._seen[replica] = (report, now)

    def _fresh(self) -> list[QueueReport]:
        now = self.clock()
        with self._lock:
            return [r for r, t in self._seen.values() if now - t <= self.ttl_s]

    def others(self) -> int:
        """The other replicas' queued requests (0 for those not heard from within ``ttl_s``)."""
        return sum(r.queued for r in self._fresh())

    def reference(self) -> tuple[float, float] | None:
        """The other replicas' unloaded TTFT (median, p90) in seconds: the most lenient of those
        heard (the largest p90), or None when none has measured one."""
        measured = [r for r in self._fresh() if r.ttft_p90_s > 0]
        if not measured:
            return None
        r = max(measured, key=lambda r: r.ttft_p90_s)
        return r.ttft_p50_s, r.ttft_p90_s
