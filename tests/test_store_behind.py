"""Prompts the decode engine computed itself (vLLM: ``decode_computes_cold``, or the rest after the
prefix its own cache held) reach the tier behind it, and the exact prefix the decode engine holds
comes before an approximate plan:
- ``StoreBehind``: the prefix compiled by a prefill worker in the background, bounded (one per
  key, in flight + queue), every outcome counted, the prompt index recorded once stored;
- in process (router + real executors, the decode engine computing cold prompts as vLLM does): a
  cold record is stored behind and a one-field change of it is then planned as an edit;
- ``DecodeHeld`` / ``prefer_exact``: an approximate plan gives way to a longer exact prefix the
  decode engine holds;
- ``RequestPlan.approx`` names only the approximate steps, so the next turn of a conversation
  composed the same way has the same vLLM ``cache_salt`` (its blocks of the previous turn are found);
  what the decode engine's cache served under such a salt is counted as composed, not exact."""
import asyncio
import time

import pytest

from cluster.control.decode_held import DecodeHeld, prefer_exact
from cluster.control.metrics import Metrics
from cluster.control.reuse_kinds import reuse_split
from cluster.control.store_behind import StoreBehind, StoreBehindConfig
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from kvruntime.messages.prefill import PrecompileInfo
from tests.conftest import metric

SALT = "s" * 32


class _Backends:
    def __init__(self, fail=False, gate: asyncio.Event | None = None):
        self.refs, self.fail, self.gate = [], fail, gate

    async def precompile(self, ref, index=0, base=None):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("prefill actor lost")
        self.refs.append(ref)
        return PrecompileInfo(False, 1, 0.01, "prefill-0", len(base.token_ids) if base is not None else 0)


class _Index:
    def __init__(self):
        self.recorded = []

    def record(self, tenant, ids):
        self.recorded.append((tenant, tuple(ids)))

    async def longest_held(self, tenant, salt, prefix, index, clock=None, extra=()):
        return None, 0                                  # the tier holds no prefix of these


def _outcomes(m: Metrics) -> dict:
    text = m.render().decode()
    return {o: metric(text, "kvnotes_prompt_stores_total", outcome=o)
            for o in ("stored", "skipped_held", "skipped_approximate", "skipped_busy", "skipped_duplicate",
                      "skipped_off", "failed")}


def test_store_behind_compiles_in_the_background_bounded_and_counted():
    async def go():
        gate = asyncio.Event()
        b, idx, m = _Backends(gate=gate), _Index(), Metrics()
        sb = StoreBehind(b, m, idx, StoreBehindConfig(in_flight=1, queue=1))
        a, c, d = (KVRef(tuple(range(k, k + 600)), 0, SALT) for k in (0, 1, 2))
        got = [sb.schedule("t", a, 0, 0), sb.schedule("t", a, 0, 0), sb.schedule("t", c, 0, 0),
               sb.schedule("t", d, 0, 0),                                   # 1 running + 1 queued: full
               sb.schedule("t", KVRef(a.token_ids, 0, SALT, "ab" * 16), 0, 0),   # a composed recipe's KV
               sb.schedule("t", KVRef(a.token_ids[:520], 0, SALT), 512, 0)]      # every whole piece held
        assert got == ["scheduled", "skipped_duplicate", "scheduled", "skipped_busy", "skipped_approximate",
                       "skipped_held"]
        assert not b.refs and not idx.recorded          # nothing on the request's path
        gate.set()
        await sb.drain()
        assert b.refs == [a, c] and idx.recorded == [("t", a.token_ids), ("t", c.token_ids)]
        assert sb.schedule("t", a, 0, 0) == "scheduled"  # done: may be stored again (the tier may have dropped it)
        await sb.drain()
        return m
    out = _outcomes(asyncio.run(go()))
    assert out == {"stored": 3, "skipped_held": 1, "skipped_approximate": 1, "skipped_busy": 1,
                   "skipped_duplicate": 1, "skipped_off": 0, "failed": 0}


def test_store_behind_failures_and_the_switch_are_counted():
    async def go():
        m, idx = Metrics(), _Index()
        sb = StoreBehind(_Backends(fail=True), m, idx)
        sb.schedule("t", KVRef(tuple(range(600)), 0, SALT), 0, 0)
        await sb.drain()
        off = StoreBehind(_Backends(), m, idx, StoreBehindConfig(enabled=False))
        assert off.schedule("t", KVRef(tuple(range(600)), 0, SALT), 0, 0) == "skipped_off"
        assert not idx.recorded
        return m
    out = _outcomes(asyncio.run(go()))
    assert out["failed"] == 1 and out["skipped_off"] == 1 and out["stored"] == 0
    with pytest.raises(ValueError):
        StoreBehindConfig(in_flight=0)


def test_the_decode_engines_exact_prefix_comes_before_a_shorter_approximate_plan(tmp_path):
    from cluster.control.state import StoreLimits, open_state
    state = open_state(f"sqlite:///{tmp_path}/state.db", StoreLimits(decode_held_max=20))
    held = DecodeHeld(state)
    turn0 = list(range(1000))
    held.note("t", turn0)
    assert held.longest("t", turn0 + [5, 6]) == 1000 and held.longest("u", turn0) == 0
    assert held.longest("t", turn0[:999] + [5]) == 960                  # whole 64-token blocks past the divergence
    assert held.longest("t", [7] + turn0) == 0
    held.note("t", list(range(5000, 6000)))            # 15 blocks + its end more: the bound (20) drops the oldest
    state.expire(time.time())
    assert held.longest("t", turn0) <= 4 * 64 and held.longest("t", list(range(5000, 6000))) == 1000
    plan = _plan([_rc(0, 30), _repos(30, 600), _rc(630, 500)])
    assert prefer_exact(plan, held=1000, hit=0)        # 1000 exact tokens beat a 600-token composition
    assert not prefer_exact(plan, held=500, hit=0)     # the composition reuses more
    assert not prefer_exact(plan, held=1000, hit=1000)  # the tier's exact prefix is in the plan already
    assert not prefer_exact(_plan([_rc(0, 1130)]), held=1000, hit=0)   # exact already
    fresh = _plan([_rc(0, 30), _repos(30, 600, reused=0), _rc(630, 500)])  # the span compiled in its build
    assert not prefer_exact(fresh, held=40, hit=0) and prefer_exact(fresh, held=700, hit=0)


def test_a_conversation_composed_the_same_way_keeps_its_vllm_salt():
    turn0 = _plan([_rc(0, 30), _repos(30, 600), _rc(630, 120)])
    turn1 = _plan([_rc(0, 30), _repos(30, 600), _rc(630, 400)])                    # the conversation grew
    later = _plan([_rc(0, 300), _repos(300, 600), _rc(900, 100)])
    tier = _plan([_reuse(0, 256), _rc(256, 44), _repos(300, 600), _rc(900, 300)])  # its head exact from the tier
    moved = _plan([_rc(0, 31), _repos(31, 600), _rc(631, 400)])                    # the chunk elsewhere
    assert turn0.approx and turn0.approx == turn1.approx and turn0.kv_salt(SALT) == turn1.kv_salt(SALT)
    assert later.approx == tier.approx and moved.approx != turn0.approx
    assert _plan([_rc(0, 30), _repos(30, 600, r=0.1), _rc(630, 120)]).approx != turn0.approx
    q0 = _plan([_rc(0, 30), _repos(30, 600, r=0.1, probe="q8"), _rc(630, 120)], suffix=(1, 2))
    q1 = _plan([_rc(0, 30), _repos(30, 600, r=0.1, probe="q8"), _rc(630, 120)], suffix=(1, 3))
    assert q0.approx != q1.approx                      # the question picked the recomputed tokens
    assert _plan([_rc(0, 750)]).kv_salt(SALT) != turn0.kv_salt(SALT)


def test_the_decode_engine_computes_the_unheld_tail_of_a_conversation_composed_the_same_way():
    from cluster.control.lifecycle import DECODE_TAIL, decode_may_compute_from
    from kvruntime.messages.plan import decode_computes_rest
    turn1 = _plan([_rc(0, 30), _repos(30, 1050), _rc(1080, 480)])       # vLLM holds turn 0 in 128-token blocks
    assert decode_may_compute_from(turn1) == 1080 - DECODE_TAIL
    assert decode_computes_rest(1024, decode_may_compute_from(turn1)) and not decode_computes_rest(1024, 1080)
    assert decode_may_compute_from(_plan([_rc(0, 30), _repos(30, 50), _rc(80, 200)])) == 31  # never before the chunk
    assert decode_may_compute_from(_plan([_reuse(0, 512), _rc(512, 100)])) == 512             # exact: unchanged
    assert decode_may_compute_from(_plan([_rc(0, 30), _repos(30, 1050), _rc(1080, 20)])) == 1080  # a repeat: as composed
    assert decode_may_compute_from(turn1, tail=0) == 1080    # vllm_decode_tail 0: off (test_decode_tail_config)


def test_what_the_decode_cache_served_under_a_composed_salt_is_composed_past_the_first_approximate_step():
    plan = _plan([_rc(0, 30), _repos(30, 600), _rc(630, 120)])
    split = reuse_split(plan, {"decode_cache": 700, "computed": 51})
    assert split == {"exact": 30, "composed": 670, "edited": 0}     # the 30 before the splice are bit-exact
    assert reuse_split(_plan([_rc(0, 750)]), {"decode_cache": 700})["exact"] == 700


def _plan(steps, suffix=(9,)):
    return RequestPlan("r", "m", Policy.FAST, tuple(steps), suffix)


def _rc(pos, n):
    return SegmentPlan(kind=PlanKind.RECOMPUTE, source="text", token_ids=tuple(range(pos, pos + n)), position=pos,
                       computed=n, reused=0)


def _reuse(pos, n):
    return SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=tuple(range(pos, pos + n)), position=pos,
                       computed=0, reused=n, kv=KVRef(tuple(range(pos, pos + n)), 0, SALT))


def _repos(pos, n, r=0.0, probe="kv1", reused=None):
    ids = tuple(range(10_000, 10_000 + n))
    return SegmentPlan(kind=PlanKind.REPOSITION, source="span:x", token_ids=ids, position=pos,
                       computed=1 if reused is None else n - reused, reused=n - 1 if reused is None else reused, kv=KVRef(ids, 1, SALT), seam_tokens=1, recompute_ratio=r, probe=probe)


@pytest.mark.slow
def test_a_cold_prompt_the_decode_engine_computed_is_stored_behind_then_edited(smol, tmp_path):
    """In process, the decode engine computing cold prompts itself as vLLM does
    (``decode_computes_cold``): no prefill runs for the first record, its KV is compiled into the
    tier behind it (the prompt index recorded), and a one-field change of it is an edit."""
    from cluster.control.context import RequestContext
    from cluster.control.router_sections import PolicySection
    from cluster.control.state import open_state
    from cluster.http.choices import prompt_details
    from kvruntime.messages.decode import SamplingParams
    from tests.test_prompt_match import record
    from tests.test_prompt_reuse import ReuseBackends
    from tests.test_router_fallback import Metrics, ModelSection, Registry, Renderer, Router

    b = ReuseBackends(smol)
    state = open_state(f"sqlite:///{tmp_path / 'state.db'}")
    router = Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                    ModelSection("m", "float32"), metrics=Metrics(), policy=PolicySection(decode_computes_cold=True))

    async def ask(ids, policy):
        fin = None
        async for ev in router.stream_prompt(RequestContext.local("default", policy=policy), list(ids),
                                             sampling=SamplingParams(max_tokens=2, temperature=0)):
            fin = ev
        await router.matcher.recurring.drain()
        await router.streams.store_behind.drain()
        return fin
    try:
        q = smol.encode("Question: what is the order's status? Answer:")
        p1, p2 = smol.encode(record("shipped")) + q, smol.encode(record("delayed")) + q
        first = asyncio.run(ask(p1, "fast"))
        assert first.plan.steps == () and not first.stored and b.calls["prefill"] == 0   # vLLM's cold path
        assert metric(router.metrics.render().decode(), "kvnotes_prompt_stores_total", outcome="stored") == 1
        assert b.source.get(KVRef(tuple(p1[:-1]), 0, router.salt("default"))) is not None
        fin = asyncio.run(ask(p2, "fast"))
        assert [s.kind for s in fin.plan.steps] == [PlanKind.EDIT_IN_PLACE], fin.plan.notes
        assert prompt_details(fin)["edited_tokens"] > 0.8 * len(p2)
    finally:
        b.rx.stop()
