"""The admission exchange: the other router replicas' queues as they are now, not a health period ago.

Each replica hears the others' admission queues through its prefill health probes
(:mod:`cluster.control.peers`): up to two health periods old. With a TTFT of the order of that
period, two replicas each taking a request "with nothing queued anywhere" at the same moment is
the common case under load, not a corner: the second one's first token then comes at about twice
the unloaded time (measured: admitted requests 0.24 s apart, one per replica, reached their first
token in 0.7, 1.4 and 1.8 s). So a request the admission would take (its own queue and the last
heard view allow it) is checked once more before any work:

1. the replica's report, its queue with this request in it, goes to one prefill worker, the
   *ledger* (the first live one: every replica picks the same while they agree on liveness), which
   records it and answers every replica's fresh report under one lock (``PrefillWorker.queues``,
   in the actor's probe concurrency group, called through the replica's prober actor so that it
   never waits behind this replica's own running plans, :mod:`cluster.control.probe`);
2. :meth:`~cluster.control.admission.Admission.confirm` decides again with those queues; a refusal
   takes the request out of the queue and sends the corrected report (without waiting), as does
   every request that leaves the queue, so the ledger holds each replica's queue as it is.

Of two replicas admitting at once, the ledger orders them: the second sees the first's request.
Only while the TTFT objective applies (the only decision the others' queues change). No answer
within ``admission_exchange_timeout_s`` (or no live prefill worker, or no prober): the decision
stays with the last heard view. Every exchange is counted by result in
``kvnotes_admission_exchanges_total{result}`` (ok, timeout, error, unavailable), the answered ones'
time in ``kvnotes_admission_exchange_seconds``; 0 turns it off.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from cluster.control.admission import Admission, Ticket
from kvruntime.messages.prefill import QueueReport

log = logging.getLogger(__name__)


class QueueExchange:
    """Held by each router replica (the HTTP layer): its reports and its exchanges with the ledger."""

    def __init__(self, replica: str, admission: Admission, backends, metrics, timeout_s: float):
        self.replica, self.admission, self.backends, self.timeout_s = replica, admission, backends, timeout_s
        self.exchanges, self.seconds = metrics.admission_exchanges, metrics.admission_exchange_seconds
        self._seq = itertools.count(1)
        admission.on_leave = self.post
        if timeout_s > 0 and admission.cfg.ttft_factor > 0:
            # the first report now, without waiting: it starts the prober actor (a process: the
            # first exchange would otherwise time out on its start) and puts this replica on the ledger
            self._send()

    def report(self) -> QueueReport:
        """This replica's queue now, numbered (a worker keeps the newest of the reports it gets)."""
        p50, p90 = self.admission.own_reference() or (0.0, 0.0)
        return QueueReport(self.replica, self.admission.total, next(self._seq), p50, p90)

    @property
    def on(self) -> bool:
        return self.timeout_s > 0 and self.admission.objective_on()

    async def admit(self, tenant: str, deadline_s: float | None = None) -> Ticket:
        """:meth:`Admission.admit`, then (while the objective applies) the exchange and
        :meth:`Admission.confirm`; a refusal raises the admission's ``RequestError``."""
        ticket = self.admission.admit(tenant, deadline_s)
        if not ticket.queued or not self.on:
            return ticket
        others = await self._exchange()
        if others is not None:
            self.admission.confirm(ticket, others)     # a refusal leaves the queue (and posts the correction)
        return ticket

    async def _exchange(self) -> int | None:
        """The other replicas' queued requests after the ledger recorded this replica's report, or
        None (counted) when it could not be asked or did not answer in time."""
        ref = self.backends.exchange_queues(self.report(), self.timeout_s)
        if ref is None:
            self.exchanges.labels("unavailable").inc()
            return None
        start = time.perf_counter()
        try:
            queues = await asyncio.wait_for(_awaited(ref), self.timeout_s)
        except asyncio.TimeoutError:
            self.exchanges.labels("timeout").inc()
            return None
        except Exception as exc:            # the worker or the prober is gone: the last heard view decides
            self.exchanges.labels("error").inc()
            log.warning("admission exchange failed (%s): deciding on the last heard queues", type(exc).__name__)
            return None
        self.exchanges.labels("ok").inc()
        self.seconds.observe(time.perf_counter() - start)
        peers = self.backends.peers
        peers.heard(queues)
        return sum(int(q.queued) for r, q in queues.items() if r != self.replica)

    def post(self) -> None:
        """Send this replica's queue to the ledger without waiting (a request left the queue)."""
        if self.on:
            self._send()

    def _send(self) -> None:
        try:
            self.backends.exchange_queues(self.report(), self.timeout_s)
        except Exception as exc:            # the next health probe carries the report anyway
            log.debug("sending the queue report failed: %s", exc)


async def _awaited(ref):
    return await ref
