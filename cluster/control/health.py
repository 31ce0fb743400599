"""The router's health thread: every ``health_period_s`` it calls each worker's cheap
``health()`` (in the actor's "probe" concurrency group, so a long decode or a backlog of cancels
does not delay it; an overdue call is asked again on a fresh path, :mod:`cluster.control.probe`)
and updates the :class:`~cluster.control.routing.WorkerView` the router routes by: a worker that does
not answer within ``health_timeout_s`` (dead, restarting, hung) is marked down and skipped; one
that answers again is brought back. It also refreshes what changes on a restart (a decode
worker's KV endpoint: gRPC address and NIXL agent metadata), the gauges
``kvnotes_workers_alive{role}`` and ``kvnotes_tier_remote_up`` (from each prefill actor's
probe-driven ``remote_up``; the recomputes a down remote tier caused are counted once, by the
prefill actor where they happened, on its own exporter). Each probe of a prefill worker carries
this replica's admission queue and brings back the other replicas' (``cluster.control.peers``). Errors the router
sees on requests mark workers down at once (``cluster.control.ray_backends``); only this thread brings
them back.
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from cluster.control.probe import PROBE_GROUP, start_prober
from cluster.control.routing import ROLES

log = logging.getLogger(__name__)
HEALTH_GROUP = "health"          # a second thread in each actor: cancel() runs beside work
# (health() and endpoint() have their own thread, cluster.control.probe.PROBE_GROUP: a backlog of
# cancels under overload cannot delay them)
# Ray errors that mean "this actor is gone or restarting" (the call may not have run)
ACTOR_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError)


class HealthMonitor(threading.Thread):
    def __init__(self, backends, metrics, period_s: float, timeout_s: float):
        super().__init__(name="kvnotes-health", daemon=True)
        self.backends, self.metrics = backends, metrics
        self.period_s, self.timeout_s = period_s, timeout_s
        self.stopped = threading.Event()
        self.calls: dict = {}            # (role, index) -> (this replica's health call in flight, issued at)
        self.fresh: dict = {}            # (role, index) -> (the prober's call in flight, issued at)
        self._probe_actor, self._probe_failed = None, False
        backends.view.on_change = self._changed
        self._publish()

    def _changed(self, role: str, index: int, alive: bool, reason: str) -> None:
        self.metrics.workers_alive.labels(role).set(len(self.backends.view.live(role)))

    def _publish(self) -> None:
        for role in ROLES:
            self.metrics.workers_alive.labels(role).set(len(self.backends.view.live(role)))
        ups = [v for v in self.backends.remote_up.values() if v is not None]
        if ups:
            self.metrics.tier_remote_up.labels("remote").set(1 if all(ups) else 0)

    def prober(self):
        """This replica's prober actor (started on first use; None when it could not start)."""
        if self._probe_actor is None and not self._probe_failed:
            try:
                self._probe_actor = start_prober()
            except Exception as exc:     # no second path: overdue answers mark workers down as before
                self._probe_failed = True
                log.warning("health prober actor could not start (%s): one health path only", exc)
        return self._probe_actor

    def sweep(self) -> None:
        """One round. Each worker has at most one health call of this replica in flight (in the
        actors' "probe" concurrency group, where only health() and endpoint() run); a call still
        unanswered after ``timeout_s`` is not repeated behind itself: the worker is asked again on
        a fresh path (:mod:`cluster.control.probe`, another caller) and marked down only when that
        fails too. An answer on either path brings a down worker back at once. The round waits at
        most ``period_s`` (at least 0.5 s) for answers."""
        b = self.backends
        now = time.monotonic()
        report = b.queue_report() if b.queue_report is not None else None
        for role in ROLES:
            for i, actor in enumerate(b.actors(role)):
                key = (role, i)
                if key not in self.calls:
                    args = (report,) if role == "prefill" and report is not None else ()
                    self.calls[key] = (actor.health.options(concurrency_group=PROBE_GROUP).remote(*args), now)
                overdue = now - self.calls[key][1] > self.timeout_s
                if overdue and key not in self.fresh:
                    prober = self.prober()
                    if prober is None:
                        b.view.mark(role, i, False, f"no health answer within {self.timeout_s:g} s")
                    else:
                        self.fresh[key] = (prober.probe.remote(actor, self.timeout_s), now)
        paths = {ref: ("own", key) for key, (ref, _) in self.calls.items()}
        paths.update({ref: ("fresh", key) for key, (ref, _) in self.fresh.items()})
        done, _ = ray.wait(list(paths), num_returns=len(paths), timeout=min(self.timeout_s, max(self.period_s, 0.5)))
        for ref in done:
            path, key = paths[ref]
            (self.calls if path == "own" else self.fresh).pop(key, None)
            if self._answer(key, ref, path) and path == "fresh":
                self.calls.pop(key, None)       # a stuck own call is forgotten: the next round asks afresh
        now = time.monotonic()
        for key, (ref, t) in list(self.fresh.items()):
            if now - t > 2 * self.timeout_s:     # the prober's own wait ends at timeout_s: it is stuck too
                self.fresh.pop(key)
                b.view.mark(*key, False, f"no health answer within {self.timeout_s:g} s on either path")
        b.health_sweeps += 1
        self._publish()

    def _answer(self, key: tuple[str, int], ref, path: str) -> bool:
        """Apply one health answer; True when the worker answered."""
        b = self.backends
        role, i = key
        try:
            info = ray.get(ref)
        except ACTOR_LOST as exc:
            b.view.mark(role, i, False, f"health: {type(exc).__name__}")
            return False
        except Exception as exc:       # health() raised, or the fresh path got no answer either
            why = "no health answer on either path" if path == "fresh" else f"health() raised {type(exc).__name__}"
            b.view.mark(role, i, False, f"{why}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}")
            return False
        restarted = b.view.workers[role][i].pid not in (None, info.get("pid"))
        b.view.workers[role][i].pid = info.get("pid")
        b.view.workers[role][i].metrics = info.get("metrics")
        b.view.workers[role][i].boot = info.get("boot")      # decode: names its prefix cache (cluster.control.decode_held)
        if role == "decode" and (restarted or (info.get("grpc") and info["grpc"] != b.addresses[i])):
            # a restarted decode actor has a new inbox address and a new NIXL agent: fetch its
            # whole KV endpoint before any push goes to it again
            try:
                ep = ray.get(b.decode_actors[i].endpoint.options(concurrency_group=PROBE_GROUP).remote(),
                             timeout=self.timeout_s)
            except Exception as exc:
                b.view.mark(role, i, False, f"endpoint refresh failed: {type(exc).__name__}")
                return False
            log.warning("decode-%d restarted: KV endpoint %s -> %s", i, b.addresses[i], ep.grpc_address)
            b.endpoints[i], b.addresses[i] = ep, ep.grpc_address
        if role == "prefill":
            b.remote_up[i] = info.get("remote_up")
            b.peers.heard(info.get("queues"))
        if path == "fresh" and b.view.is_alive(role, i):
            log.info("%s-%d answered on the fresh health path (this replica's own call is overdue)", role, i)
        b.view.mark(role, i, True)
        return True

    def run(self) -> None:
        while not self.stopped.is_set():
            if not ray.is_initialized():
                # the driver disconnected (shutdown): a Ray call now would start a new local Ray
                log.info("Ray is shut down; the health monitor stops")
                return
            try:
                self.sweep()
            except Exception:             # never let the monitor die: log and try again next period
                log.exception("health sweep failed")
            self.stopped.wait(self.period_s)
