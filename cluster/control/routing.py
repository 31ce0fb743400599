"""Which worker serves a request: the router's live view of the workers and the picking policies.

Pure bookkeeping (no Ray, no I/O): :class:`WorkerView` holds, per role (``prefill`` /
``decode``), whether each worker is alive and how much work the router has in flight on it. The
health monitor (``cluster.control.health``) and the errors the router sees mark workers down and up;
requests ``begin`` / ``end`` their load. Policies (settings in ``ClusterConfig``):

- decode: least outstanding tokens (``max_tokens`` of requests in flight), ties by rotation;
- prefill: cache affinity with a load cap (consistent hashing with bounded loads): a request
  with an affinity key goes to the first live worker in that key's rendezvous order whose
  outstanding requests stay within ``ceil(load_factor * (total + 1) / live)``, so one shared
  prefix cannot pin all traffic to one actor; requests without a key go to the least loaded.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


class NoLiveWorker(RuntimeError):
    """Every worker of a role is down (or excluded): the request cannot be placed now."""

    def __init__(self, role: str, detail: str = ""):
        super().__init__(f"no live {role} worker{': ' + detail if detail else ''} (see /health)")
        self.role = role


class DeadlineExceeded(Exception):
    def __init__(self, stage: str):
        super().__init__(f"the request's deadline passed during {stage}; its work was cancelled")
        self.stage = stage


class WorkerLost(RuntimeError):
    """A worker died (or became unreachable) while serving a call. Raised by the backends
    (``cluster.control.ray_backends`` translates Ray's actor errors) so the router can retry elsewhere."""

    def __init__(self, role: str, index: int, reason: str):
        super().__init__(f"{role} worker {role}-{index} was lost: {reason}")
        self.role, self.index, self.reason = role, index, reason


@dataclass(frozen=True)
class FaultPolicy:
    """Router-side fault settings (from ``ClusterConfig``; the backends carry them)."""
    retries: int = 1               # retries of a request whose worker died before its first token
    deadline_s: float = 600.0      # default per-request deadline
    decode_migrations: int = 1     # continuations on another decode worker of a stream whose worker died mid-stream


class Lease:
    def __init__(self, view: "WorkerView", role: str, index: int):
        self.view, self.role, self.index, self.held = view, role, index, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.view.end(self.role, self.index, 0)


@dataclass
class WorkerState:
    alive: bool = True
    requests: int = 0              # requests the router has in flight on this worker
    tokens: int = 0                # their token budget (decode: max_tokens; prefill: prompt tokens)
    since: float = 0.0             # monotonic time of the last alive/down change
    reason: str = ""               # why it is down
    pid: int | None = None         # last reported process id (health)
    metrics: str | None = None     # the worker's own metrics endpoint host:port (health)
    boot: str | None = None        # the worker process' random start id (health): a new one after a restart


class WorkerView:
    """The live view of one router replica (thread-safe: the health thread and the event loop
    both update it)."""

    def __init__(self, num_prefill: int, num_decode: int, *, prefill_load_factor: float = 1.0):
        if prefill_load_factor < 1.0:
            raise ValueError("prefill_load_factor must be >= 1.0")
        self.workers = {"prefill": [WorkerState() for _ in range(num_prefill)],
                        "decode": [WorkerState() for _ in range(num_decode)]}
        self.load_factor = prefill_load_factor
        self._rr = {r: itertools.count() for r in ROLES}
        self._lock = threading.Lock()
        self.on_change = None      # callable(role, index, alive, reason), set by the owner (metrics, logs)

    def count(self, role: str) -> int:
        return len(self.workers[role])

    def live(self, role: str) -> list[int]:
        return [i for i, w in enumerate(self.workers[role]) if w.alive]

    def is_alive(self, role: str, index: int) -> bool:
        return self.workers[role][index].alive

    def mark(self, role: str, index: int, alive: bool, reason: str = "") -> bool:
        """Set a worker alive or down; returns True if that changed its state."""
        with self._lock:
            w = self.workers[role][index]
            changed = w.alive != alive
            if changed:
                w.alive, w.since, w.reason = alive, time.monotonic(), "" if alive else reason
        if changed:
            if alive:
                log.warning("%s-%d is alive again", role, index)
            else:
                log.warning("%s-%d marked down: %s", role, index, reason)
            if self.on_change is not None:
                self.on_change(role, index, alive, reason)
        return changed

    def begin(self, role: str, index: int, tokens: int) -> None:
        with self._lock:
            w = self.workers[role][index]
            w.requests += 1
            w.tokens += tokens

    def end(self, role: str, index: int, tokens: int) -> None:
        with self._lock:
            w = self.workers[role][index]
            w.requests = max(0, w.requests - 1)
            w.tokens = max(0, w.tokens - tokens)

    def lease(self, role: str, index: int) -> "Lease":
        """Count one request on a worker from the moment it is picked (before any await), so
        concurrent picks see each other; release() is idempotent."""
        self.begin(role, index, 0)
        return Lease(self, role, index)

    def _candidates(self, role: str, exclude) -> list[int]:
        got = [i for i in self.live(role) if i not in exclude]
        if not got:
            down = [f"{role}-{i} ({w.reason or 'down'})" for i, w in enumerate(self.workers[role]) if not w.alive]
            raise NoLiveWorker(role, ", ".join(down) or "all tried")
        return got

    def pick_decode(self, exclude=()) -> int:
        """Least outstanding tokens among live decode workers; ties rotate."""
        cand = self._candidates("decode", exclude)
        start = next(self._rr["decode"])
        with self._lock:
            ws = self.workers["decode"]
            order = sorted(range(len(cand)), key=lambda k: (ws[cand[k]].tokens, ws[cand[k]].requests,
                                                            (k - start) % len(cand)))
        return cand[order[0]]

    def pick_prefill(self, key: str | None, exclude=()) -> int:
        """Affinity with a load cap (see the module doc); no key: least loaded, ties rotate."""
        cand = self._candidates("prefill", exclude)
        ws = self.workers["prefill"]
        if key is None:
            start = next(self._rr["prefill"])
            with self._lock:
                order = sorted(range(len(cand)), key=lambda k: (ws[cand[k]].requests, (k - start) % len(cand)))
            return cand[order[0]]
        ranked = sorted(cand, key=lambda i: hashlib.sha256(f"{key}|{i}".encode()).digest(), reverse=True)
        with self._lock:
            total = sum(ws[i].requests for i in cand)
            cap = math.ceil(self.load_factor * (total + 1) / len(cand))
            for i in ranked:
                if ws[i].requests + 1 <= cap:
                    return i
            return min(ranked, key=lambda i: ws[i].requests)

    def snapshot(self) -> dict:
        """Per role: live count and per-worker state (``/health``)."""
        with self._lock:
            return {role: {"live": sum(w.alive for w in ws), "total": len(ws),
                           "workers": [{"name": f"{role}-{i}", "alive": w.alive, "in_flight": w.requests, "pid": w.pid,
                                        **({"reason": w.reason} if not w.alive else {})}
                                       for i, w in enumerate(ws)]}
                    for role, ws in self.workers.items()}
