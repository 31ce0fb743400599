"""The other router replicas' queues, as the prefill workers last heard them.

Each replica's admission queue (requests admitted, not yet at their first token) is its own; R
replicas in front of P prefill workers each see only theirs. So every health probe a replica sends
to a prefill worker carries a :class:`~kvruntime.messages.prefill.QueueReport` and the worker answers
with the reports it holds from every replica (``prefill_workers.queue_reports``, fresh ones only). The replica
keeps the latest per peer (:class:`PeerQueues`): its admission adds the others' queued requests
to its own when it predicts a first token. A report is as old as one health period at most; a
replica that stops reporting (gone, restarted under a new id) drops out after ``ttl_s``.
"""
from __future__ import annotations

import threading
import time

from kvruntime.messages.prefill import REPORT_TTL_S


class PeerQueues:
    """Held by each router replica: the other replicas' queued requests, from its prefill workers'
    health answers (thread-safe: the health thread writes, admission reads)."""

    def __init__(self, me: str = "", ttl_s: float = REPORT_TTL_S, clock=time.monotonic):
        self.me, self.ttl_s, self.clock = me, ttl_s, clock
        self._seen: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def heard(self, reports: dict[str, int] | None) -> None:
        """One worker's answer: the replicas' queues it holds (this replica's own included)."""
        if not reports:
            return
        now = self.clock()
        with self._lock:
            for replica, queued in reports.items():
                if replica != self.me:
                    self._seen[replica] = (int(queued), now)

    def others(self) -> int:
        """The other replicas' queued requests (0 for those not heard from within ``ttl_s``)."""
        now = self.clock()
        with self._lock:
            return sum(q for q, t in self._seen.values() if now - t <= self.ttl_s)
