"""Online shadow checks: windows, demotion and recovery (pure), the bounded runner, the operation
a plan is booked under (frame-variant reuse, probes), and a router with real executors where an
injected drifting operation gets demoted, frame-variant reuse is checked live and booked under its
own key, and a broken frame variant is counted as an exactness bug."""
import asyncio
import logging

import pytest

from cluster.control.context import RequestContext
from cluster.control.metrics import Metrics
from cluster.control.planner import FidelityTarget, PlannerConfig, compose_op_key
from cluster.control.shadow import FRAME_REUSE_OP, FidelityGuard, FidelityMonitor, checkable, plan_op, sampled
from kvruntime.config import ShadowConfig
from kvruntime.messages.decode import SamplingParams
from kvruntime.messages.fidelity import ShadowResult
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from tests.conftest import metric

OP = compose_op_key(1, 0.0)


def _res(top1, greedy=None, kl=0.1):
    return ShadowResult("r", kl, float(top1), float(top1 if greedy is None else greedy), 1.0)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_drifting_operation_is_demoted_then_readmitted_on_probation():
    clock = Clock()
    mon = FidelityMonitor(ShadowConfig(window=10, min_samples=5, demote_s=60), clock)
    for _ in range(10):
        assert mon.record(OP, _res(1), 0.97) == []                  # faithful: nothing happens
    events = []
    for _ in range(10):                                            # the operation starts to drift
        events += mon.record(OP, _res(0), 0.97)
    assert [e.event for e in events] == ["demoted"] and events[0].agreement < 0.97
    assert events[0].samples == 10 and OP in mon.demoted and mon.snapshot()["operations"][OP]["demoted"]
    clock.t += 59
    assert mon.tick() == [] and OP in mon.demoted
    clock.t += 2
    assert [e.event for e in mon.tick()] == ["readmitted"] and OP not in mon.demoted
    assert mon.snapshot()["operations"][OP]["samples"] == 0          # probation: a fresh window
    for _ in range(4):
        assert mon.record(OP, _res(0), 0.97) == []                  # below min_samples: no verdict yet
    assert [e.event for e in mon.record(OP, _res(0), 0.97)] == ["demoted"]   # still bad: demoted again
    assert mon.snapshot()["operations"][OP]["demotions"] == 2


def test_an_operation_without_a_target_is_measured_but_never_demoted():
    mon = FidelityMonitor(ShadowConfig(window=5, min_samples=5))
    for _ in range(20):
        assert mon.record("erratum", _res(0, kl=2.0), 0.0) == []
    snap = mon.snapshot()["operations"]["erratum"]
    assert snap["top1"] == 0.0 and snap["kl_mean"] == 2.0 and not snap["demoted"]


def test_sampling_is_deterministic_by_request_and_honours_opt_out():
    cfg = ShadowConfig(fraction=0.25, opt_out_tenants=frozenset({"private"}))
    hits = [sampled(f"req-{i}", "acme", cfg) for i in range(4000)]
    assert 0.22 < sum(hits) / len(hits) < 0.28
    assert hits == [sampled(f"req-{i}", "acme", cfg) for i in range(4000)]       # same on every replica
    assert not any(sampled(f"req-{i}", "private", cfg) for i in range(4000))
    assert not any(sampled(f"req-{i}", "acme", ShadowConfig(fraction=0.0)) for i in range(100))
    assert all(sampled(f"req-{i}", "acme", ShadowConfig(fraction=1.0)) for i in range(100))
    for bad in (dict(fraction=1.5), dict(window=5, min_samples=6), dict(demote_s=0), dict(metric="cosine")):
        with pytest.raises(ValueError):
            ShadowConfig(**bad)


def _plan(rid="r1", policy=Policy.BALANCED):
    ids = tuple(range(10, 30))
    step = SegmentPlan(kind=PlanKind.REPOSITION, source="skill:x", token_ids=ids, position=3, computed=1, reused=19,
                       kv=KVRef(ids, 1, "s"), seam_tokens=1)
    return RequestPlan(rid, "m", policy, (SegmentPlan(kind=PlanKind.RECOMPUTE, source="frame", token_ids=(1, 2, 3),
                                                      position=0, computed=3, reused=0), step), (7, 8))


def _profile():
    row = lambda r: {"n": 12, "top1": 1.0, "params": {"rotate": True, "seam_tokens": 1, "recompute_ratio": r}}  # noqa: E731
    return {"meta": {"model": "m"}, "compose_sweep": {"ops": {"seam": row(0.0), "half": row(0.5)}}}


def test_guard_bounds_checks_in_flight_counts_drops_and_skips_opted_out_tenants():
    async def main():
        gate = asyncio.Event()
        calls = []

        async def slow_shadow(worker, plan):
            calls.append(plan.request_id)
            await gate.wait()
            return _res(1)
        m = Metrics()
        g = FidelityGuard(_profile(), {Policy.BALANCED: FidelityTarget()},
                          ShadowConfig(fraction=1.0, max_in_flight=2, opt_out_tenants=frozenset({"private"})),
                          m, slow_shadow, PlannerConfig())
        sent = [g.after_response(_plan(f"r{i}"), "acme", 0) for i in range(5)]
        assert sent == [True, True, False, False, False] and g.runner.in_flight == 2
        assert not g.after_response(_plan("p"), "private", 0)
        exact = RequestPlan("e", "m", Policy.EXACT, (SegmentPlan(kind=PlanKind.RECOMPUTE, source="t", token_ids=(1,),
                                                                 position=0, computed=1, reused=0),), (2,))
        assert not g.after_response(exact, "acme", 0)                   # exact plans are never checked
        gate.set()
        await g.runner.drain(10)
        text = m.render().decode()
        assert metric(text, "kvnotes_shadow_checks_total", result="dropped") == 3
        assert metric(text, "kvnotes_shadow_checks_total", result="done") == 2 and calls == ["r0", "r1"]
        assert metric(text, "kvnotes_fidelity_agree_total", op=OP, metric="top1") == 2
        assert metric(text, "kvnotes_fidelity_kl_count", plan="reposition", op=OP) == 2
    asyncio.run(main())


def test_a_question_probe_operation_is_checked_and_demoted_under_its_own_key():
    """balanced by answers picks a q-probe row; shadow results are booked under the plan step's
    probe-named key, so a demotion skips exactly that op and the guard re-chooses the next one."""
    import dataclasses

    from cluster.control.shadow import plan_op

    def arow(probe, ms):
        return {"params": {"compile": "bos", "rotate": True, "seam_tokens": 1, "recompute_ratio": 0.1, "probe": probe},
                "n": 130, "top1": 0.97, "top1_ci": [0.92, 0.99], "decision_n": 40, "decision": 1.0,
                "decision_ci": [0.91, 1.0], "answered": 130, "accuracy": 0.5, "accuracy_recompute": 0.5,
                "drop_bound": 0.01, "ms_per_request": ms}
    prof = {"meta": {"model": "m"}, "compose_answers": {"ops": {"q": arow("qlate", 1.0), "k": arow("kv1", 2.0)}}}
    target = FidelityTarget.answers()
    g = FidelityGuard(prof, {Policy.BALANCED: target}, ShadowConfig(fraction=1.0, window=5, min_samples=5),
                      Metrics(), None, PlannerConfig())
    qkey = compose_op_key(1, 0.1, "qlate")
    assert g.planner_config().balanced.op == qkey and g.planner_config().balanced.probe == "qlate"
    assert g.snapshot()["targets"]["balanced"]["accuracy_drop_bound"] == 0.02
    plan = _plan()
    step = dataclasses.replace(plan.steps[1], recompute_ratio=0.1, probe="qlate")
    qplan = dataclasses.replace(plan, steps=(plan.steps[0], step))
    assert plan_op(qplan) == qkey
    for _ in range(5):
        g._apply(g.monitor.record(plan_op(qplan), _res(0), target.minimum))
    assert qkey in g.monitor.demoted and g.planner_config().balanced.op == compose_op_key(1, 0.1)


# ---- the operation a plan is booked under; frame-variant plans are sampled too ---------------------

FRAME = (1, 2, 3)


def _frame_plan(rid="f1", policy=Policy.BALANCED, *later):
    """The chat frame, then a skill reused exactly as its variant compiled after that frame."""
    ids = tuple(range(10, 30))
    steps = (SegmentPlan(kind=PlanKind.RECOMPUTE, source="frame", token_ids=FRAME, position=0, computed=3, reused=0),
             SegmentPlan(kind=PlanKind.REUSE, source="skill:x", token_ids=ids, position=3, computed=0, reused=20,
                         kv=KVRef(ids, 3, "s", prefix=FRAME)), *later)
    return RequestPlan(rid, "m", policy, steps, (7, 8))


def _later(r=0.0, probe="kv1"):
    ids = tuple(range(40, 60))
    return SegmentPlan(kind=PlanKind.REPOSITION, source="skill:y", token_ids=ids, position=23, computed=3, reused=17,
                       kv=KVRef(ids, 1, "s"), seam_tokens=1, recompute_ratio=r, probe=probe)


def test_plan_op_books_frame_reuse_and_probes_under_their_own_keys():
    plan = _frame_plan()
    assert plan.approx == "" and checkable(plan) and plan_op(plan) == FRAME_REUSE_OP == "reuse(frame)"
    # a repositioned chunk after it is the approximate operation: the plan answers to its key
    assert plan_op(_frame_plan("f", Policy.BALANCED, _later())) == OP
    assert plan_op(_frame_plan("f", Policy.FAST, _later(0.1, "qlast"))) == "reposition(seam=1,r=0.1,probe=qlast)" \
        == compose_op_key(1, 0.1, "qlast")
    assert plan_op(_frame_plan("f", Policy.FAST, _later(0.05, "qlate"))) == compose_op_key(1, 0.05, "qlate")
    assert plan_op(_frame_plan("f", Policy.FAST, _later(0.1, "kv1"))) == compose_op_key(1, 0.1)   # the old key
    # exact reuse that is no frame variant (a cached prompt prefix) has nothing to check
    ids = tuple(range(5, 25))
    prompt = RequestPlan("p", "m", Policy.BALANCED, (SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=ids,
                                                                 position=0, computed=0, reused=20,
                                                                 kv=KVRef(ids, 0, "s")),), (7,))
    assert not checkable(prompt) and plan_op(prompt) == "reuse"
    assert not checkable(RequestPlan("n", "m", Policy.BALANCED, _frame_plan().steps, ()))   # no question


def test_frame_variant_plans_are_sampled_at_the_configured_rate_under_every_policy():
    async def main():
        booked = []

        async def shadow(worker, plan):
            return _res(1)
        g = FidelityGuard(_profile(), {Policy.BALANCED: FidelityTarget()},
                          ShadowConfig(fraction=0.3, max_in_flight=10_000, opt_out_tenants=frozenset({"private"})),
                          Metrics(), shadow, PlannerConfig())
        for i in range(600):
            policy = (Policy.BALANCED, Policy.EXACT, Policy.FAST)[i % 3]
            if g.after_response(_frame_plan(f"q{i}", policy), "acme", 0):
                booked.append(f"q{i}")
        assert booked == [f"q{i}" for i in range(600) if sampled(f"q{i}", "acme", g.cfg)]   # the sampler's own choice
        assert 0.22 < len(booked) / 600 < 0.38
        assert not any(g.after_response(_frame_plan(f"q{i}"), "private", 0) for i in range(50))
        await g.runner.drain(10)
        snap = g.snapshot()["operations"][FRAME_REUSE_OP]
        assert snap["samples"] == min(len(booked), g.cfg.window) and snap["top1"] == 1.0 and snap["exact"]
        assert snap["mismatches"] == 0 and snap["target"] == 1.0
    asyncio.run(main())


def test_an_exact_operation_that_disagrees_is_logged_and_counted_but_not_demoted(caplog):
    async def main():
        answers = iter([_res(1), _res(1, greedy=0), _res(0), _res(1), _res(0, kl=3.0)])

        async def shadow(worker, plan):
            return next(answers)
        m = Metrics()
        g = FidelityGuard(_profile(), {Policy.BALANCED: FidelityTarget()},
                          ShadowConfig(fraction=1.0, window=5, min_samples=2, max_in_flight=10), m, shadow,
                          PlannerConfig())
        with caplog.at_level(logging.ERROR, logger="cluster.control.shadow"):
            for i in range(5):
                assert g.after_response(_frame_plan(f"e{i}"), "acme", 0)
                await g.runner.drain(10)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 3 and all("EXACT operation reuse(frame)" in r.getMessage() for r in errors)
        assert "e1" in errors[0].getMessage() and "greedy-16 DIFFERS" in errors[0].getMessage()
        text = m.render().decode()
        assert metric(text, "kvnotes_fidelity_exact_mismatch_total", op=FRAME_REUSE_OP) == 3
        assert metric(text, "kvnotes_fidelity_checks_total", op=FRAME_REUSE_OP) == 5
        assert metric(text, "kvnotes_fidelity_agree_total", op=FRAME_REUSE_OP, metric="top1") == 3
        assert metric(text, "kvnotes_fidelity_demotions_total") == 0
        f = g.snapshot()
        op = f["operations"][FRAME_REUSE_OP]
        assert op["mismatches"] == 3 and op["exact"] and not op["demoted"] and f["demoted"] == []
        assert f["compose"]["balanced"]["op"] == OP                  # the compose choice is untouched
    asyncio.run(main())


# ---- the router with real executors: a drifting operation is demoted ----------------------------

@pytest.mark.slow
def test_router_demotes_an_injected_drifting_operation(smol, tmp_path):
    import torch

    from cluster.control.registry import Registry
    from cluster.control.render import Renderer
    from cluster.control.router import Router
    from cluster.control.router_sections import ModelSection, PolicySection
    from cluster.control.state import open_state
    from kvtransport.transfer.endpoints import BlockKVSender
    from kvtransport.transfer.grpc_transport import GrpcTransport
    from prefill_workers.executor import PrefillExecutor
    from prefill_workers.steps import PlanBuild
    from tests.test_router_fallback import LocalBackends

    class DriftingBuild(PlanBuild):
        """Executes plans as planned, but the r = 0 operation corrupts the chunk's values: the
        drift a shadow check must catch (other operations are executed faithfully)."""

        def _step(self, step, last):
            super()._step(step, last)
            if step.kind is PlanKind.REPOSITION and step.recompute_ratio == 0:
                out = self.run.kv                        # views of the build's buffer
                g = torch.Generator().manual_seed(0)
                noise = torch.randn(out.data[:, 1, :, -step.tokens:].shape, generator=g) * 4
                out.data[:, 1, :, -step.tokens:] += noise.to(out.data.dtype)

    class DriftingExecutor(PrefillExecutor):
        build_type = DriftingBuild

    class Backends(LocalBackends):
        async def shadow(self, index, plan):
            return self.pre.shadow(plan)

    b = Backends(smol, BlockKVSender(GrpcTransport()))
    b.pre = DriftingExecutor(smol, b.source, BlockKVSender(GrpcTransport()))
    state = open_state(f"sqlite:///{tmp_path}/state.db")
    router = Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                    ModelSection("m", "float32"), metrics=Metrics(),
                    policy=PolicySection(fidelity_summary=_profile(),
                                         balanced_target=FidelityTarget("top1", 0.97),  # next-token rows (the answer rule: above)
                                         shadow=ShadowConfig(fraction=1.0, window=3, min_samples=3, max_in_flight=4)))

    async def ask(q):
        fin = None
        async for ev in router.stream_native(RequestContext.local(policy="balanced"),
                                             [{"text": "Visitor desk notes follow."}, {"skill": "museum"}, {"text": q}],
                                             session=None, sampling=SamplingParams(max_tokens=4, temperature=0)):
            fin = ev
        await router.guard.runner.drain(120)
        return fin

    async def main():
        await router.register_chunk("skill", "default", "museum",
                                    "The Varga Museum opens at 10:00 and closes at 17:30. Entry costs 12 euros.")
        assert router.fidelity["compose"]["balanced"]["op"] == OP            # the cheapest op meeting the target
        for q in ("When does it close?", "When does it open?", "How much is entry?"):
            fin = await ask(q)
            assert fin.plan.steps[-1].recompute_ratio == 0.0
        f = router.fidelity
        assert f["demoted"] == [OP] and f["operations"][OP]["samples"] == 3 and f["operations"][OP]["top1"] < 0.97
        assert f["compose"]["balanced"]["op"] == compose_op_key(1, 0.5)
        fin = await ask("Where is the museum?")                              # re-planned without the drifting op
        step = fin.plan.steps[-1]
        assert step.kind is PlanKind.REPOSITION and step.recompute_ratio == 0.5
        assert "demoted online: " + OP in step.reason
        text = router.metrics.render().decode()
        assert metric(text, "kvnotes_fidelity_demotions_total", op=OP, event="demoted") == 1
        assert metric(text, "kvnotes_fidelity_checks_total", op=OP) == 3
        assert metric(text, "kvnotes_fidelity_kl_count", plan="reposition", op=OP) == 3
        assert metric(text, "kvnotes_shadow_checks_total", result="done") == 4
    try:
        asyncio.run(main())
    finally:
        b.rx.stop()


# ---- the router with real executors: frame-variant reuse is checked live ------------------------

def _router(smol, tmp_path, executor_cls):
    from cluster.control.registry import Registry
    from cluster.control.render import Renderer
    from cluster.control.router import Router
    from cluster.control.router_sections import ModelSection, PolicySection
    from cluster.control.state import open_state
    from kvtransport.transfer.endpoints import BlockKVSender
    from kvtransport.transfer.grpc_transport import GrpcTransport
    from tests.test_router_fallback import LocalBackends

    class Backends(LocalBackends):
        async def shadow(self, index, plan):
            return self.pre.shadow(plan)

    b = Backends(smol, BlockKVSender(GrpcTransport()))
    b.pre = executor_cls(smol, b.source, BlockKVSender(GrpcTransport()))
    state = open_state(f"sqlite:///{tmp_path}/state.db")
    router = Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                    ModelSection("m", "float32"), metrics=Metrics(),
                    policy=PolicySection(fidelity_summary=_profile(),
                                         shadow=ShadowConfig(fraction=1.0, window=10, min_samples=2, max_in_flight=4)))
    return b, router


async def _ask_default(router, q):
    """The default policy (none named), the skill first after the chat frame."""
    fin = None
    async for ev in router.stream_native(RequestContext.local(), [{"skill": "museum"}, {"text": q}], session=None,
                                         sampling=SamplingParams(max_tokens=4, temperature=0)):
        fin = ev
    await router.guard.runner.drain(120)
    return fin


MUSEUM = "The Varga Museum opens at 10:00 and closes at 17:30. Entry costs 12 euros."
QUESTIONS = ("When does it close?", "How much is entry?")


@pytest.mark.slow
def test_default_policy_frame_variant_is_shadow_checked_under_its_own_key(smol, tmp_path):
    from prefill_workers.executor import PrefillExecutor
    b, router = _router(smol, tmp_path, PrefillExecutor)

    async def main():
        await router.register_chunk("skill", "default", "museum", MUSEUM)
        for q in QUESTIONS:                       # registration compiled the variant: both reuse it
            fin = await _ask_default(router, q)
            assert fin.plan.policy is Policy.BALANCED and fin.plan.approx == ""
            reuse = [s for s in fin.plan.steps if s.kind is PlanKind.REUSE and s.kv is not None
                     and s.kv.prefix is not None]
            assert len(reuse) == 1 and reuse[0].source == "frame+skill:museum"
        op = router.fidelity["operations"][FRAME_REUSE_OP]
        assert op["samples"] == 2 and op["top1"] == 1.0 and op["greedy_exact"] == 1.0 and op["exact"]
        assert op["mismatches"] == 0 and not op["demoted"] and set(router.fidelity["operations"]) == {FRAME_REUSE_OP}
        text = router.metrics.render().decode()
        assert metric(text, "kvnotes_fidelity_checks_total", op=FRAME_REUSE_OP) == 2
        assert metric(text, "kvnotes_fidelity_agree_total", op=FRAME_REUSE_OP, metric="top1") == 2
        assert metric(text, "kvnotes_fidelity_agree_total", op=FRAME_REUSE_OP, metric="greedy16") == 2
        assert metric(text, "kvnotes_fidelity_kl_count", plan="reuse", op=FRAME_REUSE_OP) == 2
        assert 'kvnotes_fidelity_exact_mismatch_total{op="reuse(frame)"} 0.0' in text
        assert metric(text, "kvnotes_shadow_checks_total", result="done") == 2
    try:
        asyncio.run(main())
    finally:
        b.rx.stop()


@pytest.mark.slow
def test_a_broken_frame_variant_is_counted_as_an_exactness_bug(smol, tmp_path, caplog):
    import torch

    from prefill_workers.executor import PrefillExecutor
    from prefill_workers.steps import PlanBuild

    class BrokenBuild(PlanBuild):
        """Splices the frame variant with corrupted values: what an exactness bug (a wrong key, a
        stale variant) would serve. Everything else runs as planned."""

        def _frame_reuse(self, step, loaded, last):
            super()._frame_reuse(step, loaded, last)
            out = self.run.kv
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(out.data[:, 1, :, -step.tokens:].shape, generator=g) * 4
            out.data[:, 1, :, -step.tokens:] += noise.to(out.data.dtype)

    class BrokenVariant(PrefillExecutor):
        build_type = BrokenBuild

    b, router = _router(smol, tmp_path, BrokenVariant)

    async def main():
        await router.register_chunk("skill", "default", "museum", MUSEUM)
        with caplog.at_level(logging.ERROR, logger="cluster.control.shadow"):
            for q in QUESTIONS:
                await _ask_default(router, q)
        op = router.fidelity["operations"][FRAME_REUSE_OP]
        assert op["samples"] == 2 and 1 <= op["mismatches"] <= 2
        assert not op["demoted"] and router.fidelity["demoted"] == []      # counted and alerted, not demoted
        text = router.metrics.render().decode()
        assert metric(text, "kvnotes_fidelity_exact_mismatch_total", op=FRAME_REUSE_OP) == op["mismatches"]
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == op["mismatches"] and all("EXACT operation reuse(frame)" in e for e in errors)
    try:
        asyncio.run(main())
    finally:
        b.rx.stop()
