"""Admission control: refuse at once what cannot be served in time, instead of queueing it unseen.

Each router replica keeps its own queue: generation requests admitted and not yet at their first
token. It measures how fast that queue drains: the seconds between successive first tokens while
the queue is not empty (an EWMA, ``admission_ewma_alpha``; with P workers busy that is about a
P-th of one request's service time, so it is the replica's measured service rate whatever the
role that limits it; while no first token comes for longer than that, the time since the last one
is used instead, so a stall shows at once). A new request's predicted wait is ``queued x interval``; when it exceeds its
budget (``max_queue_wait_s``, or less: the request's own ``deadline_s``) the request is refused
before any work with

- **429** ``tenant_over_share`` when its tenant holds more than its share of the queue: the
  queue slots that fit in the budget divided among the tenants seen in the last
  ``admission_tenant_window_s`` (one tenant's burst cannot take the slots of another's steady
  traffic), also while the queue still has room;
- **503** ``queue_full`` (the cluster is full) or ``deadline`` (the request's own deadline is
  shorter than the predicted wait);

both with ``Retry-After``: the predicted time until the queue (or the tenant's part of it) has
drained to where the request fits. Before the first interval is measured the queue is bounded
by ``admission_cold_queue``.

A TTFT objective (``admission_ttft_factor`` F > 0) bounds the first token, not only the wait: it
is F x this replica's unloaded TTFT p90 (the p90 of the last ``TTFT_SAMPLES`` admit-to-first-token
times of requests alone from admission to first token: no other request admitted here meanwhile,
none queued at the other replicas as last heard, and none refused here from as long before its
admission until its first token: under overload no sample is taken, so the reference does not drift
up with the load; fewer than ``TTFT_MIN_SAMPLES``
samples: the other replicas' reference as last heard, ``PeerQueues.reference``, and with none
either the objective waits). A request's predicted first token is ``(Q / P + 1) x S x c``: Q the
requests queued ahead of it in the whole cluster (this replica's plus the others' as the prefill
workers' health answers last reported them, ``cluster.control.peers``; a request the admission
would take is then checked again against the others' queues as they are now, :meth:`Admission.confirm`
after the exchange of :mod:`cluster.control.exchange`), P the live prefill workers,
S the unloaded TTFT median and c the measured slowdown: the p90 of the last ``TTFT_SAMPLES``
served requests' first-token time over that model's prediction without c (a loaded machine serves
slower than an idle one, and the objective is on the p90, not the mean; 1 before 3 samples, never below 1).
Past the objective the request is refused with **503** ``ttft_objective``; one with nothing queued
ahead of it anywhere is never refused by it (it is the unloaded case; refusing it would leave the
queues empty and nothing measured again). Counted: ``kvnotes_shed_total{reason}``; gauges
``kvnotes_admission_queue_depth``, ``kvnotes_admission_predicted_wait_seconds`` and
``kvnotes_admission_service_interval_seconds``.

The HTTP layer admits (``Admission.admit``) before it reads the request's body, so a refusal
never waits for the body to come through Serve's proxy (measured: 6 ms at the median, up to 22 ms,
of a 24 ms refusal); the body's own ``deadline_s`` is checked after it
(:meth:`Admission.within_deadline`: a deadline only refuses more, and a bad body under overload is
a 503, not a 400). The ticket travels in the request's
:class:`~cluster.control.context.RequestContext`; :mod:`cluster.control.lifecycle` calls its
``first_token`` at the first token; the HTTP layer releases the ticket when the request ends (a request that ends without a first token leaves the queue without a
service sample).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from cluster.control.errors import RequestError
from cluster.control.metrics import Metrics


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True
    max_queue_wait_s: float = 30.0
    tenant_window_s: float = 10.0
    cold_queue: int = 64
    ewma_alpha: float = 0.2
    ttft_factor: float = 0.0           # 0: off; else refuse a predicted TTFT over this x the unloaded TTFT p90

    @staticmethod
    def from_config(cfg) -> "AdmissionConfig":
        return AdmissionConfig(cfg.server.admission, cfg.server.max_queue_wait_s, cfg.server.admission_tenant_window_s,
                               cfg.server.admission_cold_queue, cfg.server.admission_ewma_alpha,
                               cfg.server.admission_ttft_factor)


TTFT_SAMPLES = 20          # unloaded admit-to-first-token times kept (the objective's reference)
TTFT_MIN_SAMPLES = 3       # before that many, the TTFT objective is not applied
# one request's first-token time / its model prediction, clamped. Never below 1: the model counts the
# request in service as a whole S, so one queued behind a request nearly done comes sooner than
# modelled; a slowdown under 1 learned from those admitted a third request behind two (measured:
# their first tokens at 2.5-3x the unloaded p90)
SLOWDOWN_MIN, SLOWDOWN_MAX = 1.0, 10.0


class Ticket:
    """One admitted request's place in the queue; :meth:`first_token` and :meth:`release` are
    idempotent."""

    def __init__(self, owner: "Admission | None", tenant: str, admitted: float = 0.0, alone: bool = False,
                 model_s: float | None = None, ahead: int = 0, wait_s: float = 0.0, drain_s: float | None = None):
        self.owner, self.tenant, self.queued = owner, tenant, owner is not None
        self.admitted, self.alone = admitted, alone     # admit time; nothing else queued anywhere (so far)
        self.model_s = model_s                          # (Q / P + 1) x S at admission (None: no model yet)
        self.ahead = ahead                              # this replica's requests queued ahead of it at admission
        self.wait_s, self.drain_s = wait_s, drain_s     # predicted queue wait, s between first tokens (None: cold)

    def first_token(self) -> None:
        if self.queued:
            self.queued = False
            self.owner._left(self.tenant, served=True, ticket=self)

    def release(self) -> None:
        if self.queued:
            self.queued = False
            self.owner._left(self.tenant, served=False, ticket=self)


class Admission:
    def __init__(self, cfg: AdmissionConfig, metrics: Metrics | None = None, clock=time.monotonic,
                 workers=lambda: 1, others=lambda: 0, reference=lambda: None):
        """``workers``: live prefill workers now; ``others``: the other replicas' queued requests;
        ``reference``: the other replicas' unloaded TTFT (median, p90) s, or None."""
        self.cfg, self.clock, self.workers, self.others = cfg, clock, workers, others
        self.reference = reference
        self.on_leave = None                  # called (no arguments, outside the lock) when a request leaves the queue
        self.slowdown = 1.0                   # c: p90 of first-token time / the model's prediction
        self._ratios: deque[float] = deque(maxlen=TTFT_SAMPLES)
        self._lock = threading.Lock()
        self.queued: dict[str, int] = {}      # tenant -> admitted, not yet at the first token
        self.total = 0
        self.interval: float | None = None    # EWMA seconds between first tokens while busy
        self._mark: float | None = None       # last departure (or start of the busy period)
        self._seen: dict[str, float] = {}     # tenant -> last admit attempt
        self._unloaded: deque[float] = deque(maxlen=TTFT_SAMPLES)   # admit -> first token, alone throughout
        self._live: set[Ticket] = set()       # tickets queued now (a new admission disturbs them)
        self._last_shed: float | None = None  # when this replica last refused a request (overload: no unloaded samples)
        m = metrics or Metrics()
        self.shed, self.depth = m.shed, m.admission_depth
        self.wait, self.service, self.ttft_budget = m.admission_wait, m.admission_interval, m.admission_ttft_budget
        self.slowdown_gauge, self.peers_gauge = m.admission_slowdown, m.admission_peer_queued

    # ---- decisions ------------------------------------------------------------------------
    def admit(self, tenant: str, deadline_s: float | None = None) -> Ticket:
        """A ticket for a request of ``tenant``, or a :class:`RequestError` 429/503 with ``retry_after``;
        with the request's own ``deadline_s``, :meth:`within_deadline` too. The HTTP layer admits
        before reading the body (a refusal never waits for it) and checks the body's ``deadline_s``
        after: a deadline only ever refuses more."""
        ticket = self._admit(tenant)
        if deadline_s is not None:
            self.within_deadline(ticket, deadline_s)
        return ticket

    def within_deadline(self, ticket: Ticket, deadline_s: float) -> None:
        """Refuse (503 ``deadline``, the ticket released) an admitted request whose predicted queue
        wait at admission exceeds its own ``deadline_s``."""
        if not ticket.queued or ticket.drain_s is None or ticket.wait_s <= deadline_s:
            return
        with self._lock:
            self._last_shed = self.clock()
        ticket.release()
        self.shed.labels("deadline").inc()
        retry = max(1.0, (ticket.ahead - deadline_s / ticket.drain_s + 1) * ticket.drain_s)
        raise RequestError(503, f"the predicted queue wait ({ticket.wait_s:.1f} s) exceeds the request's deadline_s "
                                f"({deadline_s:g} s); retry after {retry:.0f} s", code="overloaded", retry_after=retry)

    def _admit(self, tenant: str) -> Ticket:
        if not self.cfg.enabled:
            return Ticket(None, tenant)
        now = self.clock()
        others = max(0, int(self.others()))
        self.peers_gauge.set(others)
        with self._lock:
            self._seen[tenant] = now
            horizon = now - self.cfg.tenant_window_s
            for t in [t for t, s in self._seen.items() if s < horizon and not self.queued.get(t)]:
                del self._seen[t]
            active = max(1, len(self._seen))
            mine, ahead, iv = self.queued.get(tenant, 0), self.total, self.interval
            if iv is not None and self._mark is not None:
                iv = max(iv, now - self._mark)    # no first token for longer than that: the service slowed
            if iv is None:                    # nothing measured yet: a bounded queue
                slots, wait, drain = float(self.cfg.cold_queue), 0.0, 1.0
                full = ahead >= self.cfg.cold_queue
            else:
                slots, wait, drain = max(1.0, self.cfg.max_queue_wait_s / iv), ahead * iv, iv
                full = wait > self.cfg.max_queue_wait_s
            share = max(1.0, slots / active)
            objective = self._ttft_budget()
            model = self._ttft_model(ahead + others)
            ttft = None if model is None else model * self.slowdown
            if active > 1 and mine + 1 > share:
                reason = "tenant_over_share"
                retry = (mine + 1 - share) * drain * active
            elif full:
                reason = "queue_full"
                retry = (ahead - slots + 1) * drain
            elif objective is not None and ttft is not None and ttft > objective and ahead + others > 0:
                reason = "ttft_objective"
                retry = ttft - objective
            else:
                self.queued[tenant] = mine + 1
                self.total += 1
                if self._mark is None:
                    self._mark = now
                self._publish()
                for t in self._live:          # no longer alone: their first token is no unloaded sample
                    t.alone = False
                # alone: nothing queued here; the others' queues are checked at its first token (a
                # report can be a health period old: the one heard now may be of a request since served)
                ticket = Ticket(self, tenant, now, alone=ahead == 0, model_s=model, ahead=ahead, wait_s=wait, drain_s=iv)
                self._live.add(ticket)
                return ticket
            self._last_shed = now
        self.shed.labels(reason).inc()
        retry = max(1.0, retry)
        if reason == "tenant_over_share":
            raise RequestError(429, f"this tenant holds {mine} of the {ahead} requests queued at this server, over "
                                    f"its share ({share:.0f}) while other tenants wait; retry after {retry:.0f} s",
                               code="tenant_over_share", retry_after=retry)
        what = (f"the predicted time to the first token ({ttft:.1f} s, {ahead + others} requests queued ahead in "
                f"the cluster) exceeds this server's objective ({objective:.1f} s: {self.cfg.ttft_factor:g} x "
                f"its unloaded TTFT p90)"
                if reason == "ttft_objective" else
                f"the server is full: {ahead} requests queued, predicted wait {wait:.1f} s over the "
                f"{self.cfg.max_queue_wait_s:g} s limit" if iv is not None else
                f"the server is full: {ahead} requests queued before any service time was measured")
        raise RequestError(503, f"{what}; retry after {retry:.0f} s", code="overloaded", retry_after=retry)

    def objective_on(self) -> bool:
        """Whether the TTFT objective applies now (on, and the unloaded TTFT measured): only then do
        the other replicas' queues change a decision (:mod:`cluster.control.exchange`)."""
        with self._lock:
            return self._ttft_budget() is not None

    def confirm(self, ticket: Ticket, others: int) -> None:
        """Check an admitted ``ticket`` again with the other replicas' queued requests as they are now
        (``others``, fresh from the exchange): past the TTFT objective it leaves the queue and a
        503 ``ttft_objective`` is raised, as :meth:`admit` would have with that view."""
        others = max(0, int(others))
        self.peers_gauge.set(others)
        with self._lock:
            if not ticket.queued:
                return
            objective, model = self._ttft_budget(), self._ttft_model(ticket.ahead + others)
            ttft = None if model is None else model * self.slowdown
            if objective is None or ttft is None or ttft <= objective or ticket.ahead + others == 0:
                ticket.model_s = model if model is not None else ticket.model_s
                return
            self._last_shed = self.clock()
        ticket.release()
        self.shed.labels("ttft_objective").inc()
        retry = max(1.0, ttft - objective)
        raise RequestError(503, f"the predicted time to the first token ({ttft:.1f} s, {ticket.ahead + others} "
                                f"requests queued ahead in the cluster) exceeds this server's objective "
                                f"({objective:.1f} s: {self.cfg.ttft_factor:g} x its unloaded TTFT p90); retry "
                                f"after {retry:.0f} s", code="overloaded", retry_after=retry)

    # ---- bookkeeping ----------------------------------------------------------------------
    def own_reference(self) -> tuple[float, float] | None:
        """This replica's own unloaded TTFT (median, p90) in seconds, or None before
        ``TTFT_MIN_SAMPLES`` samples (what its queue reports carry to the others)."""
        with self._lock:
            return self._own_reference()

    def _own_reference(self) -> tuple[float, float] | None:
        if len(self._unloaded) < TTFT_MIN_SAMPLES:
            return None
        xs = sorted(self._unloaded)
        return xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.9 * len(xs)))]

    def _reference(self) -> tuple[float, float] | None:
        """The unloaded TTFT (median, p90) the objective rests on: this replica's own, else the
        other replicas' as last heard; under the lock."""
        own = self._own_reference()
        if own is not None:
            return own
        try:
            return self.reference()
        except Exception:                     # a view that cannot answer: no reference yet
            return None

    def _ttft_budget(self) -> float | None:
        """F x the unloaded TTFT p90, or None (off, or no reference yet); under the lock."""
        ref = self._reference() if self.cfg.ttft_factor > 0 else None
        return None if ref is None else self.cfg.ttft_factor * ref[1]

    def _ttft_model(self, queued_ahead: int) -> float | None:
        """``(Q / P + 1) x S`` seconds (S the unloaded TTFT median), or None with no reference yet;
        under the lock."""
        ref = self._reference()
        return None if ref is None else (queued_ahead / max(1, int(self.workers())) + 1) * ref[0]

    def _left(self, tenant: str, served: bool, ticket: Ticket | None = None) -> None:
        now = self.clock()
        quiet = ticket is not None and ticket.alone and int(self.others()) == 0
        if quiet and self._last_shed is not None and self._last_shed >= 2 * ticket.admitted - now:
            # a refusal here while it waited, or within as long before its admission: the replica is
            # overloaded and this request, alone as it was, ran beside the work of those just before it
            # (decodes, the KV they push): not an unloaded sample (the reference would drift up with load
            # and the objective loosen as the overload goes on)
            quiet = False
        with self._lock:
            if ticket is not None:
                self._live.discard(ticket)
            if served and quiet and ticket.alone:
                # alone from admission to first token, here and at the other replicas as last
                # heard: an unloaded sample (under load none is, so the reference stays unloaded)
                self._unloaded.append(now - ticket.admitted)
            if served and ticket is not None and ticket.model_s:
                ratio = min(SLOWDOWN_MAX, max(SLOWDOWN_MIN, (now - ticket.admitted) / ticket.model_s))
                self._ratios.append(ratio)
                if len(self._ratios) >= TTFT_MIN_SAMPLES:
                    xs = sorted(self._ratios)
                    self.slowdown = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
            n = self.queued.get(tenant, 0) - 1
            if n > 0:
                self.queued[tenant] = n
            else:
                self.queued.pop(tenant, None)
            self.total = max(0, self.total - 1)
            if served and self._mark is not None:
                sample = max(now - self._mark, 1e-4)
                a = self.cfg.ewma_alpha
                self.interval = sample if self.interval is None else (1 - a) * self.interval + a * sample
                self._mark = now
            if self.total == 0:
                self._mark = None             # idle: the next busy period starts at its first admit
            self._publish()
        if self.on_leave is not None:
            self.on_leave()

    def _publish(self) -> None:
        self.ttft_budget.set(self._ttft_budget() or 0.0)
        self.slowdown_gauge.set(self.slowdown)
        self.depth.set(self.total)
        self.wait.set(self.total * (self.interval or 0.0))
        if self.interval is not None:
            self.service.set(self.interval)

    def snapshot(self) -> dict:
        with self._lock:
            return {"queued": self.total, "by_tenant": dict(self.queued), "service_interval_s": self.interval,
                    "predicted_wait_s": self.total * (self.interval or 0.0),
                    "max_queue_wait_s": self.cfg.max_queue_wait_s, "ttft_budget_s": self._ttft_budget(),
                    "slowdown": self.slowdown, "others_queued": self.others()}

