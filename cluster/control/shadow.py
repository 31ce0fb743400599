"""Online shadow checks: is an approximate operation as faithful in production as its profile says?

A configurable fraction of approximate requests (default 1%; tenants can opt out) is recomputed
in full by a prefill actor AFTER the response was sent; so is the same fraction of requests whose
first chunk is exact reuse of its variant compiled after the chat frame (:data:`FRAME_REUSE_OP`,
the default path of every policy), whose claim of exactness is thus checked live (fire and forget, a bounded number in
flight; a check that finds the queue full is dropped and counted). Each result (first-token KL,
top-1 and greedy-16 agreement) is recorded per operation in a sliding window; an operation whose
windowed agreement falls below its policy's target is *demoted*: the router re-plans with it
skipped (``cluster.control.compose_choice.choose_compose(demoted=...)``) until a cool-down passes, after which it
is admitted again on probation (fresh window) and stays only if it now meets the target. An
*exact* operation (:data:`EXACT_OPS`) has no target to fall below: any disagreement with the
recompute is a bug, logged at ERROR and counted (``kvnotes_fidelity_exact_mismatch_total{op}``,
alert ``KvnotesExactOperationDisagreed``); it is never demoted (the planner has no switch to stop
frame-variant reuse yet).

Everything here is pure (no Ray, no I/O, an injectable clock) except :class:`ShadowRunner`, a
small asyncio helper that bounds the checks in flight.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from kvruntime.config.choices import ShadowMetric
from kvruntime.config.shadow import ShadowConfig
from kvruntime.messages.fidelity import ShadowResult

log = logging.getLogger(__name__)

METRICS = tuple(m.value for m in ShadowMetric)   # agreement metrics exported and windowed (top1, greedy_exact)
FRAME_REUSE_OP = "reuse(frame)"         # the first chunk after the chat frame, reused exactly (its frame variant)
EXACT_OPS = frozenset({FRAME_REUSE_OP})  # claimed bit-exact: a disagreement is a bug, not noise


def sampled(request_id: str, tenant: str, cfg: ShadowConfig) -> bool:
    """Deterministic sampling by request id (the same request is always or never checked, on any
    router replica); opted-out tenants never are."""
    if tenant in cfg.opt_out_tenants or cfg.fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h < cfg.fraction * 2**64


@dataclass
class _OpState:
    target: float
    results: deque = field(default_factory=deque)
    demoted_until: float | None = None
    demotions: int = 0
    exact: bool = False                 # claimed exact: never demoted, every disagreement counted
    mismatches: int = 0                 # exact ops: results that disagreed with recompute (ever)


@dataclass(frozen=True)
class Transition:
    op: str
    event: str                          # "demoted" | "readmitted"
    agreement: float
    target: float
    samples: int


class FidelityMonitor:
    """Per-operation sliding windows of shadow results and the demotion state machine."""

    def __init__(self, cfg: ShadowConfig = ShadowConfig(), clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._ops: dict[str, _OpState] = {}

    def _state(self, op: str, target: float) -> _OpState:
        st = self._ops.get(op)
        if st is None:
            st = self._ops[op] = _OpState(target, deque(maxlen=self.cfg.window))
        st.target = max(st.target, target)     # an op serving two policies answers to the stricter
        return st

    def tick(self) -> list[Transition]:
        """Re-admit operations whose cool-down is over (window cleared: they start on probation)."""
        out, now = [], self.clock()
        for op, st in self._ops.items():
            if st.demoted_until is not None and now >= st.demoted_until:
                st.demoted_until = None
                st.results.clear()
                out.append(Transition(op, "readmitted", float("nan"), st.target, 0))
        return out

    def record(self, op: str, result: ShadowResult, target: float) -> list[Transition]:
        """Add one shadow result for ``op`` (planned to meet ``target`` on ``cfg.metric``). An
        exact op (:data:`EXACT_OPS`) answers to agreement 1.0 on every metric: a result below it
        counts as a mismatch (:func:`disagrees`), and it is never demoted."""
        exact = op in EXACT_OPS
        st = self._state(op, 1.0 if exact else target)
        st.exact = exact
        out = self.tick()
        st.results.append(result)
        if exact:
            st.mismatches += disagrees(result)
            return out
        if st.demoted_until is None and len(st.results) >= self.cfg.min_samples:
            agree = self.agreement(op)
            if agree < st.target:
                st.demoted_until = self.clock() + self.cfg.demote_s
                st.demotions += 1
                out.append(Transition(op, "demoted", agree, st.target, len(st.results)))
        return out

    def agreement(self, op: str, metric: str | None = None) -> float:
        st = self._ops.get(op)
        if not st or not st.results:
            return float("nan")
        m = metric or self.cfg.metric
        return sum(getattr(r, m) for r in st.results) / len(st.results)

    @property
    def demoted(self) -> frozenset[str]:
        now = self.clock()
        return frozenset(op for op, st in self._ops.items() if st.demoted_until is not None and st.demoted_until > now)

    def snapshot(self) -> dict:
        """The ``fidelity`` dict the router exposes (health details)."""
        now = self.clock()
        ops = {}
        for op, st in sorted(self._ops.items()):
            n = len(st.results)
            ops[op] = {"samples": n, "target": st.target, "metric": self.cfg.metric,
                       **{m: (sum(getattr(r, m) for r in st.results) / n if n else None) for m in METRICS},
                       "kl_mean": (sum(r.kl for r in st.results) / n if n else None),
                       "demoted": st.demoted_until is not None and st.demoted_until > now,
                       "demoted_for_s": max(0.0, st.demoted_until - now) if st.demoted_until else 0.0,
                       "demotions": st.demotions, "exact": st.exact, "mismatches": st.mismatches}
        return {"shadow_fraction": self.cfg.fraction, "window": self.cfg.window, "operations": ops,
                "demoted": sorted(self.demoted)}


class ShadowRunner:
    """Fire-and-forget checks with at most ``max_in_flight`` pending; a full runner drops the
    check and returns False (the caller counts and logs it). Holds references to its tasks."""

    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def submit(self, job: Callable[[], Awaitable[None]]) -> bool:
        if len(self._tasks) >= self.max_in_flight:
            return False
        task = asyncio.get_running_loop().create_task(job())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def drain(self, timeout: float = 60.0) -> None:
        """Wait for the checks in flight (tests, shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)


def disagrees(result: ShadowResult) -> bool:
    """An exact operation's result that is not full agreement: another first token or another
    greedy continuation than the recompute's."""
    return result.top1 < 1.0 or result.greedy_exact < 1.0


def frame_reuse_step(plan):
    """The plan's frame-variant step (a chunk reused exactly, compiled after the chat frame:
    REUSE with ``kv.prefix`` set), or None."""
    from kvruntime.messages.plan import PlanKind
    return next((s for s in plan.steps if s.kind is PlanKind.REUSE and s.kv is not None
                 and s.kv.prefix is not None), None)


def checkable(plan) -> bool:
    """A plan a shadow check can tell something about: an approximate one, or one whose first
    chunk is a frame variant (claimed exact); both need the question (the suffix)."""
    return bool(plan.suffix_ids) and (bool(plan.approx) or frame_reuse_step(plan) is not None)


def plan_op(plan) -> str:
    """The operation a shadow result is booked under: the compose key of its repositioned chunks
    with their probe (what the planner chose by target and may demote); else, for any other
    approximate plan, the plan kind; else :data:`FRAME_REUSE_OP` when its first chunk is a frame
    variant (the only thing in the plan that could make it differ from recompute); else the plan
    kind. A plan with both a frame variant and a repositioned chunk is booked under the latter:
    the approximate operation answers for the whole plan's agreement."""
    from cluster.control.compose_choice import compose_op_key
    from kvruntime.messages.plan import PlanKind
    for s in plan.steps:
        if s.kind is PlanKind.REPOSITION:
            return compose_op_key(s.seam_tokens, s.recompute_ratio, s.probe)
    if not plan.approx and frame_reuse_step(plan) is not None:
        return FRAME_REUSE_OP
    return plan.kind.value


class FidelityGuard:
    """The router's side of fidelity: the compose choice per policy (re-made when a shadow check
    demotes or readmits an operation), sampling, the bounded runner, metrics and logs."""

    def __init__(self, summary: dict | None, targets: dict, cfg: ShadowConfig, metrics,
                 shadow_fn: Callable[[int, object], Awaitable[ShadowResult]], base, clock=time.monotonic):
        self.summary, self.targets, self.cfg, self.metrics = summary, targets, cfg, metrics
        self.shadow_fn, self.base = shadow_fn, base
        self.monitor = FidelityMonitor(cfg, clock)
        self.runner = ShadowRunner(cfg.max_in_flight)
        self._config = self._choose()

    def _choose(self):
        from dataclasses import replace
        from cluster.control.compose_choice import choose_compose
        from kvruntime.messages.plan import Policy
        model = ((self.summary or {}).get("meta") or {}).get("model", "")
        ch = {p: choose_compose(self.summary, t, demoted=self.monitor.demoted, model=model)
              for p, t in self.targets.items()}
        return replace(self.base, balanced=ch.get(Policy.BALANCED), fast=ch.get(Policy.FAST))

    def planner_config(self):
        self._apply(self.monitor.tick())              # a demoted op whose cool-down ended is readmitted
        return self._config

    def _apply(self, changes: list[Transition]) -> None:
        for t in changes:
            self.metrics.fidelity_demotions.labels(t.op, t.event).inc()
            log.warning("fidelity: %s %s (online %s %.2f vs target %.2f over %d shadow checks)", t.op, t.event,
                        self.cfg.metric, t.agreement, t.target, t.samples)
        if changes:
            self._config = self._choose()

    def snapshot(self) -> dict:
        c = self._config
        choices = {name: {"allowed": x.allowed, "op": x.op, "reason": x.reason}
                   for name, x in (("balanced", c.balanced), ("fast", c.fast)) if x is not None}
        return {"targets": {p.value: t.describe() for p, t in self.targets.items()},
                "compose": choices, **self.monitor.snapshot()}

    def after_response(self, plan, tenant: str, worker: int) -> bool:
        """Maybe submit a shadow check of ``plan`` (call once the response is complete). True if submitted."""
        if not checkable(plan) or not sampled(plan.request_id, tenant, self.cfg):
            return False
        op, target = plan_op(plan), self.targets.get(plan.policy)
        goal = target.minimum if target is not None and op.startswith("reposition") else 0.0
        if not self.runner.submit(lambda: self._check(plan, op, goal, worker)):
            self.metrics.shadow_checks.labels("dropped").inc()
            log.warning("shadow check of %s dropped: %d already in flight", plan.request_id, self.runner.in_flight)
            return False
        self.metrics.shadow_checks.labels("submitted").inc()
        return True

    async def _check(self, plan, op: str, goal: float, worker: int) -> None:
        m = self.metrics
        try:
            res = await self.shadow_fn(worker, plan)
        except Exception as exc:                      # never reaches the request: it has finished
            m.shadow_checks.labels("failed").inc()
            log.warning("shadow check of %s failed: %s", plan.request_id, exc)
            return
        m.shadow_checks.labels("done").inc()
        m.fidelity_kl.labels(plan.kind.value, op).observe(res.kl)
        m.fidelity_cosine.observe(res.cosine)
        m.fidelity_checks.labels(op).inc()
        m.fidelity_agree.labels(op, "top1").inc(res.top1)
        m.fidelity_agree.labels(op, "greedy16").inc(res.greedy_exact)
        if op in EXACT_OPS and disagrees(res):        # a bug in an exact path, not approximation noise
            m.fidelity_exact_mismatch.labels(op).inc()
            log.error("fidelity: EXACT operation %s disagreed with a full recompute on request %s (top-1 %s, "
                      "greedy-16 %s, KL %.3g nats; plan: %s): an exactness bug, counted in "
                      "kvnotes_fidelity_exact_mismatch_total and alerted (KvnotesExactOperationDisagreed)",
                      op, plan.request_id, "agrees" if res.top1 >= 1.0 else "DIFFERS",
                      "agrees" if res.greedy_exact >= 1.0 else "DIFFERS", res.kl,
                      "; ".join(f"{s.kind.value} {s.source} @{s.position}+{s.tokens}" for s in plan.steps))
        self._apply(self.monitor.record(op, res, goal))
