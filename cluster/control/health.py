"""The router's health thread: every ``health_period_s`` it calls each worker's cheap
``health()`` (in the actor's "health" concurrency group, so a long decode does not delay it)
and updates the :class:`~cluster.control.routing.WorkerView` the router routes by: a worker that does
not answer within ``health_timeout_s`` (dead, restarting, hung) is marked down and skipped; one
that answers again is brought back. It also refreshes what changes on a restart (a decode
worker's KV endpoint: gRPC address and NIXL agent metadata), the gauges
``kvnotes_workers_alive{role}`` and ``kvnotes_tier_remote_up`` (from each prefill actor's
probe-driven ``remote_up``; the recomputes a down remote tier caused are counted once, by the
prefill actor where they happened, on its own exporter). Errors the router
sees on requests mark workers down at once (``cluster.control.ray_backends``); only this thread brings
them back.
"""
from __future__ import annotations

import logging
import threading

import ray

from cluster.control.routing import ROLES

log = logging.getLogger(__name__)
HEALTH_GROUP = "health"          # a second thread in each actor: health() and cancel() run beside work
# Ray errors that mean "this actor is gone or restarting" (the call may not have run)
ACTOR_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError)


class HealthMonitor(threading.Thread):
    def __init__(self, backends, metrics, period_s: float, timeout_s: float):
        super().__init__(name="kvnotes-health", daemon=True)
        self.backends, self.metrics = backends, metrics
        self.period_s, self.timeout_s = period_s, timeout_s
        self.stopped = threading.Event()
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

    def sweep(self) -> None:
        """One round: ask every worker, wait at most ``timeout_s`` for all answers."""
        b = self.backends
        calls = {}
        for role in ROLES:
            for i, actor in enumerate(b.actors(role)):
                calls[actor.health.options(concurrency_group=HEALTH_GROUP).remote()] = (role, i)
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=self.timeout_s)
        for ref in done:
            role, i = calls[ref]
            try:
                info = ray.get(ref)
            except ACTOR_LOST as exc:
                b.view.mark(role, i, False, f"health: {type(exc).__name__}")
                continue
            except Exception as exc:       # health() itself raised: the worker is not usable
                b.view.mark(role, i, False, f"health() raised {type(exc).__name__}: {exc}")
                continue
            restarted = b.view.workers[role][i].pid not in (None, info.get("pid"))
            b.view.workers[role][i].pid = info.get("pid")
            b.view.workers[role][i].metrics = info.get("metrics")
            if role == "decode" and (restarted or (info.get("grpc") and info["grpc"] != b.addresses[i])):
                # a restarted decode actor has a new inbox address and a new NIXL agent: fetch its
                # whole KV endpoint before any push goes to it again
                try:
                    ep = ray.get(b.decode_actors[i].endpoint.options(concurrency_group=HEALTH_GROUP).remote(),
                                 timeout=self.timeout_s)
                except Exception as exc:
                    b.view.mark(role, i, False, f"endpoint refresh failed: {type(exc).__name__}")
                    continue
                log.warning("decode-%d restarted: KV endpoint %s -> %s", i, b.addresses[i], ep.grpc_address)
                b.endpoints[i], b.addresses[i] = ep, ep.grpc_address
            if role == "prefill":
                b.remote_up[i] = info.get("remote_up")
            b.view.mark(role, i, True)
        for ref in pending:
            role, i = calls[ref]
            b.view.mark(role, i, False, f"no health answer within {self.timeout_s:g} s")
        b.health_sweeps += 1
        self._publish()

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
