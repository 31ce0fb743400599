"""One request as a value that travels: :class:`RequestContext`, made once at the edge
(``cluster.http.serve_app``) and passed explicitly through the router
(:mod:`cluster.control.streaming`), the runner (:mod:`cluster.control.lifecycle`) and the
metrics; nothing per request hides in a ContextVar (the one left, ``kvruntime.request_log.REQUEST_ID``,
only puts the id on log lines).

- :class:`StageClock`: the request's control-path laps (``explain.control``);
- :class:`OutcomeRecord`: what the accounting needs to count the request exactly once
  (its plan, whether its first token is out, its tenant, whether it is counted);
- :class:`Leases`: the prefill-load reservations its pick took, released when it ends;
- the admission ticket (:class:`cluster.control.admission.Ticket`): out of the queue at the first token.

The context itself is frozen: what changes during the request changes inside these records;
a request's per-choice variant (``n`` choices) is :meth:`RequestContext.choice`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Protocol


@dataclass
class StageClock:
    """One request's control-path clock: consecutive laps (``lap(name)``: seconds since the previous
    lap, so the laps add up to the time since ``start``) plus named amounts measured elsewhere
    (``add``). ``start`` and ``first_token`` are ``time.perf_counter()`` values (CLOCK_MONOTONIC on
    Linux: comparable with a client's on the same machine). Shown as ``explain.control``."""
    start: float = field(default_factory=time.perf_counter)
    laps: list = field(default_factory=list)          # (stage, seconds), in order
    extra: dict = field(default_factory=dict)          # stage -> seconds measured by a worker
    first_token: float | None = None
    _last: float | None = None

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - (self._last if self._last is not None else self.start)))
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        self.extra[name] = self.extra.get(name, 0.0) + seconds

    def as_json(self) -> dict:
        return {"start": self.start, "first_token": self.first_token,
                "laps": [[k, round(v, 6)] for k, v in self.laps], "worker": {k: round(v, 6) for k, v in self.extra.items()}}


class OutcomeRecord:
    """How one HTTP request is accounted: the router counts its final status (``Metrics.count_request``
    marks it counted); the edge counts only what never reached the router (auth, limits, bad
    bodies, planning errors) or ended without a status (a client that went away)."""

    def __init__(self, tenant: str | None = None):
        self.tenant = tenant              # None before authentication: the "none" tenant label
        self.counted = False
        self.plan: str | None = None      # the plan kind, once planned (its label if abandoned)
        self.first_token = False
        self.shed = False                 # refused at admission (its outcome label)

    def planned(self, kind: str) -> None:
        self.plan = kind

    def first_token_out(self) -> None:
        self.first_token = True

    def mark_counted(self) -> None:
        self.counted = True

    @property
    def plan_label(self) -> str:
        return self.plan or "none"

    @property
    def cancel_outcome(self) -> str:
        """The outcome of a request the client left: before or after its first token."""
        return "cancelled_after_first_token" if self.first_token else "cancelled_before_first_token"


class AdmissionTicket(Protocol):
    """A request's place in the admission queue (``cluster.control.admission.Ticket``)."""

    def first_token(self) -> None: ...

    def release(self) -> None: ...


class Leases:
    """Reservations a request holds (``WorkerView.lease``), released once, at the latest when it ends."""

    def __init__(self):
        self._held: list = []

    def add(self, lease) -> None:
        self._held.append(lease)

    def release(self) -> None:
        held, self._held = self._held, []
        for lease in held:
            lease.release()


@dataclass(frozen=True)
class RequestContext:
    request_id: str                   # the one id: the plan's, every transfer's prefix, every worker message's
    tenant: str
    policy: str | None = None         # the request's own policy (None: the router's default)
    deadline_s: float | None = None   # the request's own deadline, seconds (None: the router's)
    clock: StageClock | None = None   # None outside an HTTP request: no laps
    outcome: OutcomeRecord = field(default_factory=OutcomeRecord)
    ticket: AdmissionTicket | None = None
    leases: Leases = field(default_factory=Leases)

    @classmethod
    def local(cls, tenant: str = "default", *, policy: str | None = None, deadline_s: float | None = None,
              request_id: str | None = None, clock: StageClock | None = None) -> "RequestContext":
        """A context for a request that does not come through HTTP (scripts, tests): no ticket, and
        no clock unless one is given."""
        return cls(request_id or uuid.uuid4().hex, tenant, policy, deadline_s, clock, OutcomeRecord(tenant))

    def with_body(self, *, policy: str | None, deadline_s: float | None) -> "RequestContext":
        """The same request with what its body asked for."""
        return replace(self, policy=policy, deadline_s=deadline_s)

    def admitted(self, ticket: AdmissionTicket) -> "RequestContext":
        """The same request holding its admission ticket."""
        return replace(self, ticket=ticket)

    def choice(self, request_id: str) -> "RequestContext":
        """One of the request's ``n`` choices: its own id and leases; the same clock, outcome and ticket."""
        return replace(self, request_id=request_id, leases=Leases())

    def lap(self, name: str) -> None:
        if self.clock is not None:
            self.clock.lap(name)

    def add(self, name: str, seconds: float) -> None:
        if self.clock is not None:
            self.clock.add(name, seconds)

    def leave_queue(self) -> None:
        """Out of the admission queue with a service sample (its first token, or its end without one)."""
        if self.ticket is not None:
            self.ticket.first_token()

    def first_token(self) -> None:
        """The first token is out: out of the admission queue, and a cancel after it is
        ``cancelled_after_first_token``."""
        self.leave_queue()
        self.outcome.first_token_out()
