"""Plain prompts matched past their exact prefix, in process (router + real executors + real
gRPC, no Ray; the cluster tests go through the `openai` client): a registered skill pasted into a
prompt at any offset is composed; a document two prompts share is compiled once on its own (in the
build of the prompt that sees it the second time, or in the background where that prompt's policy
recomputes it) and reused at another offset; a prompt one field away from a held one is planned as
an edit of the held KV (``fast``) and declined where the policy does not allow it; the reuse is
split by kind in usage and the metrics; fingerprints survive a router restart and stay within
their tenant."""
import asyncio

import pytest
import torch

from cluster.control.context import RequestContext
from cluster.control.matching import MatchConfig
from cluster.control.router_sections import PolicySection
from cluster.control.state import open_state
from cluster.http.choices import prompt_details
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.plan import PlanKind
from tests.conftest import metric
from tests.test_prompt_reuse import ReuseBackends
from tests.test_router_fallback import make_router

pytestmark = pytest.mark.slow

SKILL = ("Refund policy of ACME Outfitters. Unworn items may be returned within 30 days of delivery with the "
         "receipt. Sale items are final. Refunds go back to the original payment method within five business "
         "days; store credit is issued at once on request. Damaged deliveries are replaced free of charge when "
         "reported within 48 hours with a photo. Gift returns receive store credit only. Shipping costs are not "
         "refunded unless the item arrived damaged or the wrong item was sent.")


def doc(topic: str, n: int = 14) -> str:
    """A document as a RAG app pastes one: its lines, then a blank line."""
    return "\n".join(f"{topic} note {i}: the {topic} ledger lists item {i * 7 % 31} at shelf {i * 5 % 17}."
                     for i in range(n)) + "\n\n"


def record(status: str) -> str:
    lines = [f"field_{i}: value {i * 37 % 101} for the order" for i in range(40)]
    lines.insert(30, f"status: {status}")     # past the tier's first 256-token piece
    return "Order record\n" + "\n".join(lines) + "\n"


def _router(smol, b, path, **match):
    from tests.test_router_fallback import Renderer, Registry, Router, ModelSection, Metrics
    state = open_state(f"sqlite:///{path}")
    return Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                  ModelSection("m", "float32"), metrics=Metrics(),
                  policy=PolicySection(matching=MatchConfig(**match)))


@pytest.fixture
def rig(smol, tmp_path):
    b = ReuseBackends(smol)
    yield _router(smol, b, tmp_path / "state.db"), b, tmp_path
    b.rx.stop()


async def _prompt(router, ids, policy, tenant="default", max_tokens=4):
    toks, fin = [], None
    async for ev in router.stream_prompt(RequestContext.local(tenant, policy=policy), list(ids),
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    await router.matcher.recurring.drain()          # what the prompt teaches, recorded in the background
    return toks, fin


def run(router, ids, policy="fast", tenant="default"):
    return asyncio.run(_prompt(router, ids, policy, tenant))


def steps(fin):
    return [(s.kind, s.source, s.tokens) for s in fin.plan.steps]


def test_a_registered_skill_pasted_into_a_prompt_is_composed_at_its_offset(smol, rig):
    router, b, _ = rig
    asyncio.run(router.register_chunk("skill", "default", "refund", SKILL))
    skill = router.state.get_registration("default", "skill", "refund").token_ids
    ids = smol.encode("You are the support agent of a shop.\n\n") + list(skill) + smol.encode(
        "Customer: may I return shoes I wore once? Answer:")
    _, fin = run(router, ids, "fast")
    chunk = [s for s in fin.plan.steps if s.source == "skill:refund"]
    core = router.matcher.core(skill)                 # as a prompt pastes it: without its trailing "\n\n"
    assert len(core) == len(skill) - 1
    assert len(chunk) == 1 and chunk[0].kind is PlanKind.REPOSITION and chunk[0].tokens == len(core)
    assert chunk[0].reused > 0                          # the core was compiled at registration, not on first use
    assert any("skill:refund at tokens" in n for n in fin.plan.notes)
    details = prompt_details(fin)
    assert details["composed_tokens"] == chunk[0].reused > 0
    assert details["cached_tokens"] == fin.cached_tokens == sum(details[f"{k}_tokens"]
                                                                for k in ("exact", "composed", "edited"))
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_reused_tokens_total", kind="composed") == details["composed_tokens"]
    # policy exact: matched, but recomputed (a repositioned chunk is not a recompute's KV), and counted
    want, exact = run(router, ids, "exact")
    assert all(s.kind is not PlanKind.REPOSITION for s in exact.plan.steps)
    assert metric(router.metrics.render().decode(), "kvnotes_reuse_miss_total", reason="policy") >= len(core)
    off = _router(smol, b, rig[2] / "off.db", enabled=False)
    got, plain = run(off, ids, "exact")
    assert got == want and all(s.source != "skill:refund" for s in plain.plan.steps)


def test_a_document_seen_in_an_earlier_prompt_is_compiled_on_its_own_in_the_second_and_reused_from_the_third(
        smol, rig):
    """Sighting by sighting: the 1st prompt holding a document teaches (nothing to reuse: its KV
    was computed in that prompt's context); the 2nd splices it, compiled on its own in this very
    request's build (computed, not reused); the 3rd, at another offset, reuses it from the tier
    (``compile_after: 2``: no document-like unit is compiled on its first sighting)."""
    _, b, tmp = rig
    router = _router(smol, b, tmp / "after2.db", compile_after=2)
    d1, d2, d3 = (smol.encode(doc(t)) for t in ("harbour", "orchard", "quarry"))
    q = smol.encode("\n\nQuestion: which shelf holds item 3? Answer:")
    p1 = smol.encode("Context A.\n\n") + d1 + d2 + q
    p2 = smol.encode("Other context.\n\n") + d3 + d2 + q
    _, fin1 = run(router, p1)
    assert not [s for s in fin1.plan.steps if s.source.startswith("span:")]
    compiled_before = b.source.compiled
    _, fin2 = run(router, p2)
    spans2 = [s for s in fin2.plan.steps if s.source.startswith("span:")]
    assert len(spans2) == 1 and spans2[0].kind is PlanKind.REPOSITION, steps(fin2)
    span = spans2[0]
    assert span.tokens >= 0.9 * len(d2) and span.computed == span.tokens and span.reused == 0
    # compiled in this build: computed for this request, never reused (the prefill worker's tally
    # counts the chunk it spliced as repositioned; usage and the metrics count what the plan reused)
    assert prompt_details(fin2) == {"cached_tokens": 0, "exact_tokens": 0, "composed_tokens": 0, "edited_tokens": 0}
    assert fin2.cached_tokens == 0
    assert metric(router.metrics.render().decode(), "kvnotes_reused_tokens_total", kind="composed") == 0
    assert any("recurs (seen in an earlier prompt)" in n for n in fin2.plan.notes)
    # the tier holds the span's own KV: compiled in its frame at its canonical position, bit for bit
    # a registration's compile of its ids, not KV taken from p1's context
    from kvruntime.ops import precompile_chunk
    assert span.kv.position == router.renderer.chunk_position and b.source.compiled == compiled_before + 1
    stored, alone = b.source.get(span.kv), precompile_chunk(smol, list(span.kv.token_ids), None)
    assert torch.equal(stored.data, alone.data) and torch.equal(stored.positions, alone.positions)
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled_in_request") == 1
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled") == 0      # no second compile
    d4 = smol.encode(doc("meadow"))
    p3 = smol.encode("Third one, longer intro.\n\n") + d4 + d2 + q          # d2 (and q) at another offset
    _, fin3 = run(router, p3)
    spans3 = [s for s in fin3.plan.steps if s.source.startswith("span:")]
    assert [s.source for s in spans3] == [span.source] and spans3[0].kind is PlanKind.REPOSITION
    assert spans3[0].reused > 0 and b.source.compiled == compiled_before + 1
    assert prompt_details(fin3)["composed_tokens"] > 0.8 * len(d2)
    # a router restarted on the same state store matches it the same; another tenant does not
    _, repeat = run(router, p3)          # the same composed prompt again: its stored recipe, reused whole
    assert [(s.kind, s.source) for s in repeat.plan.steps] == [(PlanKind.REUSE, "context")]
    again = _router(smol, b, tmp / "after2.db", compile_after=2)
    p4 = smol.encode("A fourth prompt, from the restarted router.\n\n") + d2 + q
    _, fin4 = run(again, p4)
    assert [s.source for s in fin4.plan.steps if s.source.startswith("span:")] == [span.source], (
        steps(fin4), fin4.plan.notes)
    _, other = run(again, p4, tenant="globex")
    assert not [s for s in other.plan.steps if s.source.startswith("span:")]


def test_a_recurring_span_the_policy_recomputes_is_compiled_in_the_background_instead(smol, rig):
    """Under ``exact`` the 2nd sighting recomputes the document in context (a spliced chunk is not
    a recompute's KV): nothing is compiled in its build; the background compile stores it for the
    policies that splice, and a later ``fast`` prompt reuses it."""
    _, b, tmp = rig
    router = _router(smol, b, tmp / "after2.db", compile_after=2)
    d1, d2, d3 = (smol.encode(doc(t)) for t in ("harbour", "orchard", "quarry"))
    q = smol.encode("\n\nQuestion: which shelf holds item 3? Answer:")
    run(router, smol.encode("Context A.\n\n") + d1 + d2 + q, "exact")
    _, fin2 = run(router, smol.encode("Other context.\n\n") + d2 + q, "exact")
    assert all(s.kind is not PlanKind.REPOSITION for s in fin2.plan.steps), steps(fin2)
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled") == 1
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled_in_request") == 0
    _, fin3 = run(router, smol.encode("Third, fast.\n\n") + d3 + d2 + q, "fast")     # no edit of the second
    got = [s for s in fin3.plan.steps if s.source.startswith("span:")]
    assert got and got[0].kind is PlanKind.REPOSITION and got[0].reused > 0, steps(fin3)


def test_a_one_field_change_of_a_held_prompt_is_planned_as_an_edit(smol, rig):
    router, b, _ = rig
    q = smol.encode("Question: what is the order's status? Answer:")
    p1 = smol.encode(record("shipped")) + q
    p2 = smol.encode(record("delayed")) + q
    assert len(p1) > 300
    _, first = run(router, p1, "exact")
    assert first.stored
    _, fin = run(router, p2, "fast")
    assert [s.kind for s in fin.plan.steps] == [PlanKind.EDIT_IN_PLACE]
    assert any("first divergence from the nearest held prompt" in n for n in fin.plan.notes)
    details = prompt_details(fin)
    assert details["edited_tokens"] > 0.8 * len(p2) and details["composed_tokens"] == 0
    # the tier keeps stored prompts in whole 256-token pieces (LMCache drops a last partial one): the
    # edit starts from the held prompt's longest whole-piece prefix and computes the rest in context
    b.source.keep_only(2 * 256)
    _, cut = run(router, smol.encode(record("lost")) + q, "fast")
    assert [s.kind for s in cut.plan.steps] == [PlanKind.EDIT_IN_PLACE, PlanKind.RECOMPUTE], steps(cut)
    assert cut.plan.steps[0].kv.token_ids == first.plan.prefix_ids[:512]
    # balanced without a profile row for edits: declined, the exact prefix reused, the rest computed
    p3 = smol.encode(record("returned")) + q
    _, declined = run(router, p3, "balanced")
    assert PlanKind.EDIT_IN_PLACE not in [s.kind for s in declined.plan.steps]
    assert declined.plan.steps[0].kind is PlanKind.REUSE and declined.plan.steps[0].kv.exact
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_reuse_miss_total", reason="edit_declined") > 0
    assert metric(text, "kvnotes_reused_tokens_total", kind="edited") == \
        details["edited_tokens"] + prompt_details(cut)["edited_tokens"]


def test_a_skill_pasted_into_a_native_text_segment_is_split_out_and_composed(smol, rig):
    router, _, _ = rig
    asyncio.run(router.register_chunk("skill", "default", "refund", SKILL))
    asyncio.run(router.register_chunk("memory", "default", "note", "The customer is Dana, a member since 2019."))
    segs = [{"text": "Policy excerpt follows.\n" + SKILL + "\n\nEnd of excerpt."}, {"memory": "note"},
            {"text": "May Dana return worn shoes?"}]

    async def native(policy):
        fin = None
        async for ev in router.stream_native(RequestContext.local("default", policy=policy), segs, session=None,
                                             sampling=SamplingParams(max_tokens=4, temperature=0)):
            fin = ev if not isinstance(ev, TokenEvent) else fin
        return fin
    fin = asyncio.run(native("fast"))
    got = [s for s in fin.plan.steps if s.source == "skill:refund"]
    assert len(got) == 1 and got[0].kind is PlanKind.REPOSITION and got[0].reused > 0, steps(fin)
    assert prompt_details(fin)["composed_tokens"] >= got[0].reused


def test_the_second_sighting_on_a_restarted_router_finds_the_first_in_the_store(smol, rig):
    """Only the state store remembers the first sighting: a router started on it after that
    prompt compiles the recurring document in the second prompt's build."""
    _, b, tmp = rig
    router = _router(smol, b, tmp / "after2.db", compile_after=2)
    d1, d2, d3 = (smol.encode(doc(t)) for t in ("harbour", "orchard", "quarry"))
    q = smol.encode("\n\nQuestion: which shelf holds item 3? Answer:")
    run(router, smol.encode("Context A.\n\n") + d1 + d2 + q)
    again = _router(smol, b, tmp / "after2.db", compile_after=2)
    _, fin = run(again, smol.encode("Other context.\n\n") + d3 + d2 + q)
    spans = [s for s in fin.plan.steps if s.source.startswith("span:")]
    assert spans and spans[0].kind is PlanKind.REPOSITION and spans[0].tokens >= 0.9 * len(d2), (
        steps(fin), fin.plan.notes)
    assert metric(again.metrics.render().decode(), "kvnotes_recurring_spans_total", outcome="compiled_in_request") == 1


def test_documents_are_compiled_on_their_first_sighting_and_reused_reordered_from_the_second(smol, rig):
    """``compile_after: 1`` (the default): the document-like units of a prompt whose policy splices
    (blocks between blank lines, their numbered label left out) are compiled on their own in the
    background after its answer, so the next prompt holding them in another order, at other
    offsets and under other labels reuses them; under ``exact`` nothing is compiled for it."""
    router, b, _ = rig
    d1, d2, d3 = (smol.encode(doc(t)) for t in ("harbour", "orchard", "quarry"))
    q = smol.encode("\n\nQuestion: which shelf holds item 3? Answer:")
    label = lambda k: smol.encode(f"[{k}] ")                                   # noqa: E731  a reranker's rank
    run(router, smol.encode("Context.\n\n") + label(1) + d1 + label(2) + d2 + q, "exact", tenant="globex")
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_recurring_spans_total", outcome="unit_first_sighting") == 0
    compiled = b.source.compiled
    _, fin1 = run(router, smol.encode("Context A.\n\n") + label(1) + d1 + label(2) + d2 + q, "fast")
    assert not [s for s in fin1.plan.steps if s.source.startswith("span:")]     # nothing held yet
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_recurring_spans_total", outcome="unit_first_sighting") == 2
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled") == 2 == b.source.compiled - compiled
    p2 = smol.encode("Another, longer context line.\n\n") + label(1) + d3 + label(2) + d2 + label(3) + d1 + q
    _, fin2 = run(router, p2, "fast")
    spans = [s for s in fin2.plan.steps if s.source.startswith("span:")]
    assert len(spans) == 2 and all(s.kind is PlanKind.REPOSITION and s.reused > 0 for s in spans), steps(fin2)
    # each the document's own ids (label and trailing blank line left out), its KV compiled in its frame
    from kvruntime.ops import precompile_chunk
    docs = sorted(s.kv.token_ids for s in spans)
    assert docs == sorted(tuple(router.matcher.core(d)) for d in (d1, d2))
    alone = precompile_chunk(smol, list(spans[0].kv.token_ids), None)
    assert torch.equal(b.source.get(spans[0].kv).data, alone.data)
    details = prompt_details(fin2)
    assert details["composed_tokens"] == sum(s.reused for s in spans) > 0.8 * (len(d1) + len(d2))
    assert details["cached_tokens"] == fin2.cached_tokens == details["composed_tokens"]
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_recurring_spans_total", outcome="compiled") == 3      # d3, after p2's answer
    assert metric(text, "kvnotes_reused_tokens_total", kind="composed") == details["composed_tokens"]
