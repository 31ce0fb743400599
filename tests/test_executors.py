"""Prefill and decode executors on the real model over a real gRPC transport (no Ray)."""
import dataclasses
import uuid

import pytest
import torch

from kvruntime.messages.plan import KVRef, PlanKind, Policy
from cluster.control.planner import RenderedRequest, RenderedSegment, SessionContext, TierView, plan_request
from decode_workers.executor import DecodeExecutor
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.ops import precompile_chunk, recompute
from kvtransport.transfer.endpoints import BlockKVSender
from kvtransport.transfer.grpc_transport import GrpcTransport
from kvtransport.transfer.interface import KVSender, SendResult, TransferError, TransferReceipt
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource




@pytest.fixture(scope="module")
def wired(smol):
    rx = GrpcTransport(model=smol.spec.name)
    addr = rx.serve()
    src = DictSource(smol)
    pre = PrefillExecutor(smol, src, BlockKVSender(GrpcTransport()))
    dec = DecodeExecutor(smol, rx, receive_timeout=5)
    yield smol, src, pre, dec, addr
    pre.transport.stop()
    rx.stop()


def _run(pre, dec, addr, plan, sampling=SamplingParams(max_tokens=12), store_as=None):
    tid = uuid.uuid4().hex
    res = pre.execute(plan, addr, tid, store_as=store_as)
    prefix = tuple(t for s in plan.steps for t in s.token_ids)
    events = list(dec.generate(tid if res.transferred else None, prefix, plan.suffix_ids, sampling))
    return res, [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


SALT = "5a" * 16


def _segments(e):
    frame = RenderedSegment("frame", None, tuple(e.encode(e.spec.chat_user_prefix)))
    ids = tuple(e.encode("The Varga Museum opens at 10:00 and closes at 17:30; entry costs 12 euros.\n\n"))
    skill = RenderedSegment("skill", "museum", ids, kv=KVRef(ids, 1, SALT))
    q = tuple(e.encode("When does the Varga Museum close?" + e.spec.chat_user_suffix))
    return frame, skill, q


def _as_text(frame):
    """The same ids as plain context text: a chunk after it is not first after the frame, so it keeps
    the reposition / recompute rules (the first chunk after the frame is exact reuse)."""
    return dataclasses.replace(frame, kind="text")


@pytest.mark.slow
def test_exact_plan_output_equals_direct_recompute(wired):
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    res, toks, summary = _run(pre, dec, addr, plan)
    assert res.transferred and res.transfer_bytes > 0 and summary.fallbacks == ()
    full = recompute(e, list(frame.token_ids + skill.token_ids + q))
    assert toks == [t for t in e.greedy(full.kv, full.logits, 12, stop_at_eos=True) if t not in e.eos_ids]


@pytest.mark.slow
def test_reposition_plan_loads_chunk_from_tier(wired):
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    src.put(skill.kv, precompile_chunk(e, list(skill.token_ids)))
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.FAST, (_as_text(frame), skill), q),
                        TierView(frozenset({skill.kv.digest})), None, e.encode)
    assert plan.steps[1].kind is PlanKind.REPOSITION
    res, toks, summary = _run(pre, dec, addr, plan)
    assert res.stats.tier_hits == 1 and res.stats.repositioned == len(skill.token_ids) - 1
    assert res.stats.fallbacks == [] and len(toks) > 0


@pytest.mark.slow
def test_a_chunk_missing_at_execution_is_rewarmed_and_runs_as_planned(wired):
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.FAST, (_as_text(frame), skill), q),
                        TierView(frozenset({skill.kv.digest})), None, e.encode)   # planner believed it was there
    src.d.clear()
    res, toks, _ = _run(pre, dec, addr, plan)
    assert res.stats.fallbacks == [] and res.stats.rewarmed == 1 and res.stats.tier_hits == 0
    assert res.stats.repositioned == len(skill.token_ids) - 1 and src.get(skill.kv) is not None
    res2, toks2, _ = _run(pre, dec, addr, plan)                      # stored back: the next use hits
    assert res2.stats.rewarmed == 0 and res2.stats.tier_hits == 1 and toks2 == toks


@pytest.mark.slow
def test_missing_session_context_is_a_counted_fallback_to_recompute(wired):
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    ctx = frame.token_ids + skill.token_ids
    sess = SessionContext("s", KVRef(ctx, 0, SALT), (frame, skill), ctx)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.FAST, (frame, skill), q, "s"), TierView(), sess,
                        e.encode)
    assert [s.kind for s in plan.steps] == [PlanKind.REUSE]
    res, toks, _ = _run(pre, dec, addr, plan)
    assert res.stats.fallbacks == ["kv_load_failed"] and res.stats.computed == plan.prefix_tokens


@pytest.mark.slow
def test_session_erratum_round_trip(wired):
    e, src, pre, dec, addr = wired
    frame, _, _ = _segments(e)
    q = tuple(e.encode("What is the status of flight LX318? Answer in one word." + e.spec.chat_user_suffix))
    def booking(status):
        before, after = e.encode("Flight LX318 status: "), e.encode(". Gate B12.\n")
        v = tuple(e.encode(status))
        return RenderedSegment("template", "booking", tuple(before) + v + tuple(after), fields=(("status", status),),
                               field_spans=(("status", len(before), len(before) + len(v)),))
    turn1 = plan_request(RenderedRequest("r1", e.spec.name, Policy.FAST, (frame, booking("ON TIME")), q, "s"),
                         TierView(), None, e.encode)
    ctx_ids = turn1.prefix_ids
    ref = KVRef(ctx_ids, 0, SALT, turn1.approx)
    assert _run(pre, dec, addr, turn1, store_as=ref)[0].stored
    sess = SessionContext("s", ref, (frame, booking("ON TIME")), ctx_ids, (("booking", (("status", "ON TIME"),)),))
    turn2 = plan_request(RenderedRequest("r2", e.spec.name, Policy.FAST, (frame, booking("CANCELLED")), q, "s"),
                         TierView(), sess, e.encode)
    assert [s.kind for s in turn2.steps] == [PlanKind.REUSE, PlanKind.ERRATUM]
    res, toks, summary = _run(pre, dec, addr, turn2, SamplingParams(max_tokens=24))
    assert res.stats.reused == len(ctx_ids) and res.stats.erratum > 0 and res.stats.fallbacks == []
    assert "cancel" in summary.text.lower()


@pytest.mark.slow
def test_corrupted_block_is_recomputed_by_decode(wired):
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    prefix = tuple(t for s in plan.steps for t in s.token_ids)
    from kvtransport.transfer.blocks import encode_block
    kv, _ = pre.build(plan)
    block = encode_block("bad-1", e.spec.name, kv)
    bad = dataclasses.replace(block, header=dataclasses.replace(block.header, checksum=block.header.checksum ^ 7))
    with pytest.raises(Exception):
        pre.transport.blocks.send(addr, bad, timeout=5)           # the block transport under the sender
    events = list(dec.generate("bad-1", prefix, plan.suffix_ids, SamplingParams(max_tokens=8)))
    summary = events[-1]
    assert isinstance(summary, DecodeSummary) and summary.fallbacks == ("kv_transfer_rejected",)
    full = recompute(e, list(prefix + plan.suffix_ids))
    want = [t for t in e.greedy(full.kv, full.logits, 8, stop_at_eos=True) if t not in e.eos_ids]
    assert [ev.token_id for ev in events if isinstance(ev, TokenEvent)] == want


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_reposition_plan_executes_the_planned_recompute_ratio(wired, ratio):
    """The executor carries out the plan's r: its KV is what ops.compose(recompute_ratio=r) builds
    (r = 1: a full recompute), and the stats count the selectively recomputed tokens."""
    from cluster.control.planner import ComposeChoice, PlannerConfig, compose_op_key
    from kvruntime.ops import ChunkSegment, TextSegment, blend_count, compose
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    src.put(skill.kv, precompile_chunk(e, list(skill.token_ids)))
    cfg = PlannerConfig(balanced=ComposeChoice(True, 1, ratio, compose_op_key(1, ratio), "test"))
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.BALANCED, (_as_text(frame), skill), q),
                        TierView(frozenset({skill.kv.digest})), None, e.encode, cfg)
    assert plan.steps[1].recompute_ratio == ratio
    chunk_before = src.get(skill.kv).data.clone()
    kv, st = pre.build(plan)
    # the recompute writes into the executor's own buffer, never into the tier's chunk
    assert torch.equal(src.get(skill.kv).data, chunk_before)
    assert torch.equal(pre.build(plan)[0].data, kv.data)
    want = compose(e, [TextSegment(list(frame.token_ids)), ChunkSegment(src.get(skill.kv))], seam_tokens=1,
                   recompute_ratio=ratio)
    assert torch.equal(kv.data, want.kv.data)
    n = len(skill.token_ids)
    extra = blend_count(ratio, n - 1)
    assert st.computed == len(frame.token_ids) + 1 + extra and st.repositioned == n - 1 - extra
    if ratio == 1.0:
        full = recompute(e, list(frame.token_ids + skill.token_ids), logits=False).kv
        assert torch.allclose(kv.data, full.data, atol=5e-4)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_a_question_probe_plan_recomputes_the_tokens_the_question_picks(wired, ratio):
    """A REPOSITION step with r > 0 and a question probe: the executor ranks the chunk's tokens by
    the attention the plan's suffix pays to them (ops.qselect), so its KV is exactly the prefix of
    what ops.compose(probe="qlate") builds in process for the same inputs (the question as the
    text after the chunk); r = 1 equals a full recompute. Without a suffix it falls back to kv1,
    counted in the stats."""
    from cluster.control.planner import ComposeChoice, PlannerConfig, compose_op_key
    from kvruntime.ops import ChunkSegment, TextSegment, blend_count, compose
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    src.put(skill.kv, precompile_chunk(e, list(skill.token_ids)))
    key = compose_op_key(1, ratio, "qlate")
    cfg = PlannerConfig(balanced=ComposeChoice(True, 1, ratio, key, "test", probe="qlate"))
    plan = plan_request(RenderedRequest("rq", e.spec.name, Policy.BALANCED, (_as_text(frame), skill), q),
                        TierView(frozenset({skill.kv.digest})), None, e.encode, cfg)
    assert plan.steps[1].probe == "qlate" and plan.steps[1].recompute_ratio == ratio and key.endswith("probe=qlate)")
    chunk_before = src.get(skill.kv).data.clone()
    kv, st = pre.build(plan)
    assert torch.equal(src.get(skill.kv).data, chunk_before) and not st.fallbacks
    want = compose(e, [TextSegment(list(frame.token_ids)), ChunkSegment(src.get(skill.kv)), TextSegment(list(q))],
                   seam_tokens=1, recompute_ratio=ratio, probe="qlate")
    assert torch.equal(kv.data, want.kv.data[:, :, :, :kv.num_tokens])
    n = len(skill.token_ids)
    extra = blend_count(ratio, n - 1)
    assert st.computed == len(frame.token_ids) + 1 + extra and st.repositioned == n - 1 - extra
    kv1 = compose(e, [TextSegment(list(frame.token_ids)), ChunkSegment(src.get(skill.kv))], seam_tokens=1,
                  recompute_ratio=ratio)
    if ratio == 1.0:
        full = recompute(e, list(frame.token_ids + skill.token_ids), logits=False).kv
        assert torch.allclose(kv.data, full.data, atol=5e-4)
    else:       # the question picks other tokens than the layer-1 deviation probe
        assert not torch.equal(kv.data, kv1.kv.data)
    no_q, st2 = pre.build(dataclasses.replace(plan, suffix_ids=()))
    assert st2.fallbacks == ["question_probe_without_suffix"] and torch.equal(no_q.data, kv1.kv.data)


@pytest.mark.slow
def test_shadow_check_of_an_exact_plan_agrees_and_of_a_naive_one_measures_the_drift(wired):
    """PrefillExecutor.shadow: the plan as executed vs a full recompute. An exact plan agrees
    fully (KL ~ 0); a reposition plan reports its real KL (> 0), the same the harness measures."""
    from kvruntime.fidelity.metrics import kl_divergence
    from kvruntime.ops import ChunkSegment, TextSegment, compose
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    exact = plan_request(RenderedRequest("rx", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    r = pre.shadow(exact)
    assert r.request_id == "rx" and r.kl < 1e-6 and r.top1 == 1.0 and r.greedy_exact == 1.0
    src.put(skill.kv, precompile_chunk(e, list(skill.token_ids)))
    fast = plan_request(RenderedRequest("rf", e.spec.name, Policy.FAST, (_as_text(frame), skill), q),
                        TierView(frozenset({skill.kv.digest})), None, e.encode)
    got = pre.shadow(fast)
    comp = compose(e, [TextSegment(list(frame.token_ids)), ChunkSegment(src.get(skill.kv)), TextSegment(list(q))])
    full = recompute(e, list(frame.token_ids + skill.token_ids + q))
    assert got.kl > 1e-6 and abs(got.kl - kl_divergence(full.logits, comp.logits)) < 1e-6
    with pytest.raises(ValueError):
        pre.shadow(dataclasses.replace(fast, suffix_ids=()))


def _frame_with(e, system: str) -> tuple[int, ...]:
    """SmolLM2's frame (system prompt + user-turn opener) with another system prompt."""
    import re
    prefix, n = re.subn(r"(<\|im_start\|>system\n).*?(<\|im_end\|>)", lambda m: m.group(1) + system + m.group(2),
                        e.spec.chat_user_prefix, flags=re.S)
    assert n == 1, "the model's frame carries no system prompt"
    return tuple(e.encode(prefix))


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.EXACT, Policy.BALANCED, Policy.FAST])
def test_the_same_skill_after_two_system_prompts_is_compiled_twice_and_each_prefix_is_exact(wired, policy):
    """The frame and the first chunk after it are one exact reuse of their variant compiled
    together from position 0: one variant per frame (two tier entries, two compiles), then tier
    hits that compute no token at all; the composed prefix (frame included) is bit-for-bit the KV
    of one forward over frame + chunk, and the greedy output through a decode worker is the
    recompute's."""
    e, src, pre, dec, addr = wired
    _, skill, q = _segments(e)
    frames = [_frame_with(e, "You answer museum questions."), _frame_with(e, "You are a terse clerk.")]
    assert frames[0] != frames[1]
    compiled0 = src.compiled
    keys = set()
    for f in frames:
        frame = RenderedSegment("frame", None, f)
        plan = plan_request(RenderedRequest("r", e.spec.name, policy, (frame, skill), q), TierView(), None, e.encode)
        (step,) = plan.steps
        assert step.kind is PlanKind.REUSE and step.kv.prefix == () and step.kv.token_ids == f + skill.token_ids
        assert step.position == 0 and plan.approx == ""
        kv, st = pre.build(plan)
        assert st.variants_compiled == 1 and st.fallbacks == [] and st.computed == len(f) + len(skill.token_ids)
        keys.add(src._k(step.kv))
        full = recompute(e, list(f + skill.token_ids), logits=False).kv
        assert torch.equal(kv.data, full.data)                          # frame and chunk: exact
        assert kv.positions.tolist() == list(range(len(f) + len(skill.token_ids)))
        res, toks, summary = _run(pre, dec, addr, plan)                  # stored: now a tier hit
        assert res.stats.variants_compiled == 0 and res.stats.computed == 0
        assert res.stats.reused == len(f) + len(skill.token_ids)
        assert res.stats.tier_hits == 1 and res.stats.fallbacks == [] and summary.fallbacks == ()
        whole = recompute(e, list(f + skill.token_ids + q))
        assert toks == [t for t in e.greedy(whole.kv, whole.logits, 12, stop_at_eos=True) if t not in e.eos_ids]
    assert len(keys) == 2 and src.compiled - compiled0 == 2 and all(k in src.d for k in keys)
    for k in list(keys):
        src.d.pop(k)                                                   # the next parametrisation compiles again


@pytest.mark.slow
def test_a_frame_variant_that_does_not_match_is_a_counted_fallback(wired):
    """The executor never re-plans: a variant planned after other context (its prefix is not the
    context built so far), or a loaded variant whose ids or positions are not the step's, is
    recomputed in context and counted, never spliced."""
    e, src, pre, dec, addr = wired
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.FAST, (frame, skill), q), TierView(), None, e.encode)
    (step,) = plan.steps
    bad = dataclasses.replace(plan, steps=(
        dataclasses.replace(step, kind=PlanKind.RECOMPUTE, token_ids=step.token_ids[:1], kv=None, computed=1),
        dataclasses.replace(step, token_ids=step.token_ids[1:], position=1)))
    kv, st = pre.build(bad)
    assert st.fallbacks == ["kv_mismatch"] and st.variants_compiled == 0 and st.computed == bad.prefix_tokens
    full = recompute(e, list(step.token_ids), logits=False).kv
    shifted = dataclasses.replace(full, positions=full.positions + 1)      # the right ids at the wrong positions
    src.put(step.kv, shifted)
    kv, st = pre.build(plan)
    assert st.fallbacks == ["kv_mismatch"] and st.tier_hits == 1 and st.reused == 0
    assert st.computed == step.tokens and torch.equal(kv.positions, full.positions)
    src.d.pop(src._k(step.kv))


@pytest.mark.slow
def test_the_worker_tier_counts_each_frame_variant_it_compiles(smol):
    """PrefillTier.compile of a frame-prefixed ref compiles after that prefix (canonical position
    len(prefix)) and counts it; the worker's endpoint exports the count."""
    from types import SimpleNamespace
    from prometheus_client import generate_latest
    from prefill_workers.metrics import worker_registry
    from prefill_workers.tier_reads import PrefillTier

    class Store:                                     # PrefillTier needs put/contains; the collector stats
        def __init__(self):
            self.d = {}
            self.stats = SimpleNamespace(hits_by_tier={}, misses={}, put_bytes=0, get_bytes=0, evictions=0,
                                         put_tier_failures={})

        def put(self, key, kv):
            self.d[key] = kv
            return kv.nbytes

        def contains(self, key):
            return key in self.d

        def occupancy(self):
            return {}

    store = Store()
    tier = PrefillTier(store, smol)
    ids = tuple(smol.encode("The Varga Museum closes at 17:30.\n\n"))
    frames = [_frame_with(smol, "You answer museum questions."), _frame_with(smol, "You are a terse clerk.")]
    for f in frames:
        kv = tier.compile(KVRef(ids, len(f), SALT, prefix=f))
        assert kv.positions.tolist() == list(range(len(f), len(f) + len(ids)))
    tier.compile(KVRef(ids, 1 if smol.bos_id is not None else 0, SALT))          # the default anchor: no variant
    assert tier.variants_compiled == 2 and len(store.d) == 3
    whole = tier.compile(KVRef(frames[0] + ids, 0, SALT, prefix=()))             # the planner's frame variant
    assert whole.positions.tolist() == list(range(len(frames[0]) + len(ids)))     # frame slots kept
    assert torch.equal(whole.data, recompute(smol, list(frames[0] + ids), logits=False).kv.data)
    assert tier.variants_compiled == 3 and len(store.d) == 4
    with pytest.raises(ValueError):
        tier.compile(KVRef(frames[0] + ids, 1, SALT, prefix=()))                    # from position 0 only
    assert tier.precompile(KVRef(ids, len(frames[0]), SALT, prefix=frames[0])).cached and tier.variants_compiled == 3
    with pytest.raises(ValueError):
        tier.compile(KVRef(ids, 1, SALT, prefix=frames[0]))                        # wrong canonical position
    text = generate_latest(worker_registry(store, "prefill-0", False, variants=lambda: tier.variants_compiled)).decode()
    assert 'kvnotes_worker_chunk_variants_compiled_total{worker="prefill-0"} 3.0' in text


def _chunk_plan(e, src, n_chunks=4, chunk=24):
    """Frame + first chunk as one exact reuse, then ``n_chunks - 1`` chunks repositioned (no seam):
    the tier is read once per step and nothing is computed."""
    from kvruntime.messages.plan import RequestPlan, SegmentPlan
    frame, _, q = _segments(e)
    steps, pos = [], 0
    for k in range(n_chunks):
        ids = tuple(e.encode(f" Room {k} of the Varga Museum shows {k * 7} paintings.\n\n"))[:chunk]
        if k == 0:
            ref = KVRef(frame.token_ids + ids, 0, SALT, prefix=())
            steps.append(SegmentPlan(kind=PlanKind.REUSE, source="frame+skill:c0", token_ids=ref.token_ids,
                                     position=0, computed=0, reused=len(ref.token_ids), kv=ref))
        else:
            ref = KVRef(ids, 1, SALT)
            steps.append(SegmentPlan(kind=PlanKind.REPOSITION, source=f"skill:c{k}", token_ids=ids, position=pos,
                                     computed=0, reused=len(ids), kv=ref))
        if src.get(ref) is None:
            src.compile(ref)
        pos += len(ref.token_ids)
    return RequestPlan("r", e.spec.name, Policy.FAST, tuple(steps), q)


@pytest.mark.slow
def test_prefetched_tier_reads_build_the_same_kv_and_keep_fallbacks_and_cancellation(wired):
    """Reads issued ahead (prefetch 1 and 2) build exactly what reads in line build; a chunk the
    tier lost is re-warmed, one whose read fails raises as before, and a cancelled build leaves
    no prefetch thread behind."""
    import threading
    from kvruntime.engine import Cancelled
    e, src, _, _, _ = wired
    plan = _chunk_plan(e, src)
    inline = PrefillExecutor(e, src, None, prefetch=0)
    want, st0 = inline.build(plan)
    assert st0.tier_hits == 4 and st0.computed == 0 and not st0.fallbacks
    for depth in (1, 2):
        ahead = PrefillExecutor(e, src, None, prefetch=depth)
        kv, st = ahead.build(plan)
        assert torch.equal(kv.data, want.data) and torch.equal(kv.positions, want.positions)
        assert (st.tier_lookups, st.tier_hits, st.reused, st.repositioned, st.computed) == \
            (st0.tier_lookups, st0.tier_hits, st0.reused, st0.repositioned, st0.computed)
    lost = plan.steps[2].kv
    saved = src.d.pop(src._k(lost))                                    # the tier lost chunk 2: re-warmed
    kv, st = PrefillExecutor(e, src, None, prefetch=1).build(plan)
    assert st.rewarmed == 1 and st.tier_hits == 3 and torch.equal(kv.data, want.data)
    src.d[src._k(lost)] = saved

    class Failing:                                                      # the read of chunk 3 fails
        def get(self, ref):
            if ref == plan.steps[3].kv:
                raise OSError("tier read failed")
            return src.get(ref)

        def compile(self, ref):
            return src.compile(ref)

    with pytest.raises(OSError):
        PrefillExecutor(e, Failing(), None, prefetch=1).build(plan)
    calls = []
    with pytest.raises(Cancelled):
        PrefillExecutor(e, src, None, prefetch=2).build(plan, cancelled=lambda: calls.append(1) or len(calls) > 2)
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-prefetch")]
    with pytest.raises(ValueError):
        PrefillExecutor(e, src, None, prefetch=-1)


def _mixed_plan(e, src, n_chunks=6):
    """8 steps: frame + chunk 0 as one exact reuse, chunks 1-2 repositioned (seam 1), a text step
    recomputed in context, chunks 3-5 repositioned (seam 1), an erratum appended; and the same
    context as ``compose`` segments (concatenated step by step, the pre-buffer algorithm)."""
    from kvruntime.messages.plan import RequestPlan, SegmentPlan
    from kvruntime.ops import ChunkSegment, TextSegment
    frame, _, q = _segments(e)
    steps, segs, pos = [], [], 0

    def tier(ref):
        if src.get(ref) is None:
            src.compile(ref)
        return src.get(ref)

    def add(step, seg):
        nonlocal pos
        steps.append(step)
        segs.append(seg)
        pos += step.tokens
    for k in range(n_chunks):
        ids = tuple(e.encode(f" Room {k} of the Varga Museum shows {k * 7} paintings.\n\n"))
        if k == 0:
            ref = KVRef(frame.token_ids + ids, 0, SALT, prefix=())
            add(SegmentPlan(kind=PlanKind.REUSE, source="frame+skill:c0", token_ids=ref.token_ids, position=0,
                            computed=0, reused=len(ref.token_ids), kv=ref),
                ChunkSegment(tier(ref), prefix=()))
        else:
            ref = KVRef(ids, 1, SALT)
            add(SegmentPlan(kind=PlanKind.REPOSITION, source=f"skill:c{k}", token_ids=ids, position=pos, computed=1,
                            reused=len(ids) - 1, kv=ref, seam_tokens=1),
                ChunkSegment(tier(ref)))
        if k == 2:
            text = tuple(e.encode(" Visitors asked about the opening hours."))
            add(SegmentPlan(kind=PlanKind.RECOMPUTE, source="text", token_ids=text, position=pos, computed=len(text),
                            reused=0), TextSegment(list(text)))
    fix = tuple(e.encode(" Correction: the museum closes at 18:00."))
    add(SegmentPlan(kind=PlanKind.ERRATUM, source="erratum", token_ids=fix, position=pos, computed=len(fix), reused=0), TextSegment(list(fix)))
    return RequestPlan("r", e.spec.name, Policy.FAST, tuple(steps), q), segs


@pytest.mark.slow
def test_an_eight_step_build_writes_one_buffer_allocated_once_and_equals_the_concatenated_build(wired):
    """The prefix KV is allocated once, at the plan's final size, through the alloc hook (the NIXL
    send pool in production), and is the KV returned; it is bit-for-bit what composing the same
    segments by concatenation gives (exact reuse, re-rotation, batched seam repair, forwards in
    context), the tier's chunks are never written, and a pool with no room (None) still builds it,
    in ordinary memory. A plan of one exact reuse returns the tier's KV itself: no allocation."""
    from kvruntime.ops import compose
    e, src, _, _, _ = wired
    plan, segs = _mixed_plan(e, src)
    assert len(plan.steps) == 8
    tier_before = [s.kv.data.clone() for s in segs if hasattr(s, "kv")]
    want = compose(e, segs, seam_tokens=1)
    calls = []

    def alloc(shape, dtype):
        calls.append(torch.empty(shape, dtype=dtype))
        return calls[-1]
    kv, st = PrefillExecutor(e, src, None).build(plan, alloc)
    assert len(calls) == 1 and calls[0].shape[3] == plan.prefix_tokens == kv.num_tokens
    assert kv.data.data_ptr() == calls[0].data_ptr() and kv.data.is_contiguous()
    assert torch.equal(kv.data, want.kv.data)
    assert kv.positions.tolist() == list(range(plan.prefix_tokens)) and kv.token_ids.tolist() == list(plan.prefix_ids)
    assert not st.fallbacks and st.tier_hits == 6 and st.reused == plan.steps[0].tokens
    assert st.computed == 5 + plan.steps[3].tokens and st.erratum == plan.steps[-1].tokens
    assert st.repositioned == sum(s.tokens - 1 for s in plan.steps if s.kind is PlanKind.REPOSITION)
    assert all(torch.equal(s.kv.data, b) for s, b in zip([s for s in segs if hasattr(s, "kv")], tier_before))
    full, _ = PrefillExecutor(e, src, None).build(plan, lambda shape, dtype: calls.append(None))
    assert len(calls) == 2 and torch.equal(full.data, want.kv.data)        # no room: ordinary memory
    hit = dataclasses.replace(plan, steps=plan.steps[:1])
    kv, st = PrefillExecutor(e, src, None).build(hit, alloc)
    assert len(calls) == 2 and kv.data.data_ptr() == src.get(hit.steps[0].kv).data.data_ptr()


def test_a_kv_buffer_is_written_left_to_right_and_refuses_to_overflow():
    from kvruntime.kv import KVBuffer, KVCache
    buf = KVBuffer(torch.zeros(2, 2, 1, 5, 4))
    part = KVCache(torch.randn(2, 2, 1, 3, 4, dtype=torch.float64), torch.arange(3), torch.tensor([7, 8, 9]))
    kv = buf.append(part)
    assert kv.num_tokens == 3 and kv.data.data_ptr() == buf.data.data_ptr() and kv.data.dtype == torch.float32
    assert torch.equal(kv.data, part.data.float()) and kv.token_ids.tolist() == [7, 8, 9]
    buf.slot(2).fill_(1.0)
    kv = buf.commit(torch.tensor([3, 4]), torch.tensor([1, 2]))
    assert kv.positions.tolist() == [0, 1, 2, 3, 4] and bool((buf.data[:, :, :, 3:] == 1).all())
    with pytest.raises(ValueError, match="overflow"):
        buf.append(part.slice(0, 1))


@pytest.mark.slow
def test_one_executor_runs_two_builds_at_once_and_each_is_its_own(wired):
    """The executor keeps no per-build state (each build is its own PlanBuild): two plans built
    at the same time on one executor give exactly the KV and stats each gives alone."""
    import threading
    e, src, _, _, _ = wired
    pre = PrefillExecutor(e, src, None)
    mixed, _ = _mixed_plan(e, src)
    chunks = _chunk_plan(e, src)
    alone = {p.steps[-1].source: pre.build(p) for p in (mixed, chunks)}
    got, errors = {}, []

    def run(plan):
        try:
            got[plan.steps[-1].source] = pre.build(plan)
        except Exception as exc:                    # reported below: a thread's error would be lost
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(p,)) for p in (mixed, chunks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got.keys() == alone.keys()
    for key, (kv, st) in alone.items():
        kv2, st2 = got[key]
        assert torch.equal(kv2.data, kv.data) and torch.equal(kv2.positions, kv.positions)
        assert (st2.computed, st2.reused, st2.repositioned, st2.erratum, st2.fallbacks) == \
            (st.computed, st.reused, st.repositioned, st.erratum, st.fallbacks)


class _Recording(KVSender):
    """A test double of the transfer interface: records what it was given, answers ``result``
    or raises ``error``."""

    def __init__(self, result=None, error=None):
        self.result, self.error, self.sent = result, error, []

    def send(self, to, transfer_id, model, kv, *, credential, timeout):
        self.sent.append((to, transfer_id, model, kv.token_ids.tolist(), credential))
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.slow
def test_the_executor_ships_through_the_kvsender_interface_and_reports_its_result(wired):
    """Any KVSender: the executor sends the built prefix (from ``send_from`` on) with the
    transfer's credential and reports the sender's result as is (bytes, seconds, transport,
    stages, fallbacks); a TransferError is a counted ``kv_transfer_<reason>``, not raised."""
    e, src, _, _, _ = wired
    chunks = _chunk_plan(e, src)
    plan = dataclasses.replace(chunks, steps=chunks.steps[:1])                      # one exact reuse
    ok = _Recording(SendResult(TransferReceipt("t1", 1234, 0.25), "nixl", {"serialise": 0.01, "transfer": 0.25},
                               ("kv_transport_nixl_to_grpc",)))
    res = PrefillExecutor(e, src, ok).execute(plan, "decode-0", "t1", credential="c", send_from=3)
    assert ok.sent == [("decode-0", "t1", e.spec.name, list(plan.prefix_ids[3:]), "c")]
    assert res.transferred and res.transport == "nixl" and (res.transfer_bytes, res.transfer_seconds) == (1234, 0.25)
    assert res.stats.stages["transfer"] == 0.25 and res.stats.fallbacks == ["kv_transport_nixl_to_grpc"]
    assert res.stats.not_sent == 3 and res.prefix_tokens == plan.prefix_tokens
    bad = _Recording(error=TransferError("backpressure", "inbox full"))
    res = PrefillExecutor(e, src, bad).execute(plan, "decode-0", "t2")
    assert not res.transferred and res.transport == "" and res.stats.fallbacks == ["kv_transfer_backpressure"]
    with pytest.raises(ValueError, match="KVSender"):
        PrefillExecutor(e, src, None).execute(plan, "decode-0", "t3")
