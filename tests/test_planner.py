"""The planner is a pure function: these tests need no model, no Ray, no I/O."""
import dataclasses

import pytest

from kvruntime.messages.plan import KVRef, PlanKind, Policy
from cluster.planner import (EditChoice, PlannerConfig, RenderedRequest, RenderedSegment, SessionContext,
                             TierView, choose_edit_kind, plan_request)


def encode(text):          # stands in for a tokenizer: one id per word
    return [len(w) for w in text.split()]


FRAME = RenderedSegment("frame", None, (1, 2, 3))
SALT = "ab" * 16
SKILL = RenderedSegment("skill", "refund-policy", tuple(range(100, 140)), kv=KVRef(tuple(range(100, 140)), 1, SALT))
MEM = RenderedSegment("memory", "user-42", tuple(range(200, 230)), kv=KVRef(tuple(range(200, 230)), 1, SALT))
CTX = KVRef((1, 2, 3), 0, SALT)


def booking(status, gate="B12", version="v1"):
    ids = (50, 51) + (90 if status == "ON TIME" else 91, 92) + (52, 53, 54) + (60,) + (55, 56)
    return RenderedSegment("template", "booking", ids, fields=(("status", status), ("gate", gate)),
                           field_spans=(("status", 2, 4), ("gate", 7, 8)), labels=(("status", "flight status"),),
                           version=version)


def req(*segs, policy=Policy.FAST, session=None, suffix=(7, 8, 9)):
    return RenderedRequest("r1", "smollm2-135m", policy, tuple(segs), suffix, session)


def session_of(*segs, errata=0, approx=""):
    ids = tuple(t for s in segs for t in s.token_ids)
    cur = tuple((s.name, s.fields) for s in segs if s.kind == "template")
    return SessionContext("agent-17", KVRef(ids, 0, SALT, approx), tuple(segs), ids, cur, errata)


def test_reposition_when_policy_allows_and_an_evicted_chunk_is_rewarmed():
    tier = TierView(frozenset({SKILL.kv.digest}))
    fast = plan_request(req(FRAME, SKILL, MEM), tier, None, encode)
    assert [s.kind for s in fast.steps] == [PlanKind.RECOMPUTE, PlanKind.REPOSITION, PlanKind.REPOSITION]
    rep, warm = fast.steps[1], fast.steps[2]
    assert rep.position == 3 and rep.seam_tokens == 1 and rep.computed == 1 and rep.reused == 39 and rep.kv == SKILL.kv
    assert warm.computed == 30 and warm.reused == 0 and warm.kv == MEM.kv and "re-warmed" in warm.reason
    assert any("user-42 is not in the tier: re-warmed" in n for n in fast.notes)
    assert fast.approx and len(fast.approx) == 32
    exact = plan_request(req(FRAME, SKILL, policy=Policy.EXACT), tier, None, encode)
    assert [s.kind for s in exact.steps] == [PlanKind.RECOMPUTE, PlanKind.RECOMPUTE]
    assert exact.reused_tokens == 0 and exact.kind is PlanKind.RECOMPUTE
    assert fast.kind is PlanKind.REPOSITION and fast.prompt_tokens == 3 + 40 + 30 + 3
    assert exact.approx == ""                     # recompute only: exact KV, storable for exact sessions


def test_exact_never_reuses_an_approximate_session_context():
    approx_sess = session_of(FRAME, SKILL, booking("ON TIME"), approx="c0ffee")
    p = plan_request(req(FRAME, SKILL, booking("ON TIME"), policy=Policy.EXACT, session="agent-17"), TierView(),
                     approx_sess, encode)
    assert all(s.kind is PlanKind.RECOMPUTE for s in p.steps) and p.approx == ""
    assert any("approximate" in n for n in p.notes)
    exact_sess = session_of(FRAME, SKILL, booking("ON TIME"))
    p = plan_request(req(FRAME, SKILL, booking("ON TIME"), policy=Policy.EXACT, session="agent-17"), TierView(),
                     exact_sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE] and p.approx == ""
    fast = plan_request(req(FRAME, SKILL, booking("ON TIME"), session="agent-17"), TierView(), approx_sess, encode)
    assert [s.kind for s in fast.steps] == [PlanKind.REUSE] and fast.approx   # reusing approximate KV is approximate


def test_a_reregistered_template_is_planned_from_scratch():
    sess = session_of(FRAME, booking("ON TIME", version="v1"))
    p = plan_request(req(FRAME, booking("ON TIME", version="v2"), session="agent-17"), TierView(), sess, encode)
    assert all(s.kind is PlanKind.RECOMPUTE for s in p.steps)
    assert any("re-registered" in n for n in p.notes)


def test_unchanged_session_is_reused_whole_under_any_policy():
    sess = session_of(FRAME, SKILL, booking("ON TIME"))
    for policy in Policy:
        p = plan_request(req(FRAME, SKILL, booking("ON TIME"), policy=policy, session="agent-17"), TierView(), sess, encode)
        assert [s.kind for s in p.steps] == [PlanKind.REUSE]
        assert p.reused_tokens == len(sess.token_ids) and p.computed_tokens == 3


def test_changed_field_becomes_erratum_under_fast():
    sess = session_of(FRAME, SKILL, booking("ON TIME"))
    p = plan_request(req(FRAME, SKILL, booking("CANCELLED"), session="agent-17"), TierView(), sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.ERRATUM]
    err = p.steps[1]
    assert err.edits[0].old == "ON TIME" and err.edits[0].new == "CANCELLED" and err.edits[0].label == "flight status"
    assert err.position == len(sess.token_ids)
    assert err.token_ids == tuple(encode("\nCorrection: the flight status is now CANCELLED.\n"))
    assert p.kind is PlanKind.ERRATUM
    explained = p.explain()
    assert explained["kind"] == "erratum" and explained["steps"][1]["edits"][0]["field"] == "status"


def test_changed_field_under_balanced_or_exact_is_recomputed_with_a_note():
    sess = session_of(FRAME, booking("ON TIME"))
    for policy in (Policy.BALANCED, Policy.EXACT):
        p = plan_request(req(FRAME, booking("CANCELLED"), policy=policy, session="agent-17"), TierView(), sess, encode)
        assert {s.kind for s in p.steps} == {PlanKind.RECOMPUTE}
        assert any("needs 'fast'" in n for n in p.notes)


def test_errata_accumulate_against_current_values():
    """Turn 3 compares with the value the last erratum set, not the original rendering."""
    sess = session_of(FRAME, booking("ON TIME"))
    sess = dataclasses.replace(sess, current_fields=(("booking", (("status", "DELAYED"), ("gate", "B12"))),), errata=1)
    same = plan_request(req(FRAME, booking("DELAYED"), session="agent-17"), TierView(), sess, encode)
    assert [s.kind for s in same.steps] == [PlanKind.REUSE]
    moved = plan_request(req(FRAME, booking("DELAYED", gate="C3"), session="agent-17"), TierView(), sess, encode)
    assert moved.steps[1].edits[0].field == "gate" and moved.steps[1].edits[0].old == "B12"


def test_edit_in_place_when_the_fidelity_table_prefers_it():
    cfg = PlannerConfig(edit=EditChoice(PlanKind.EDIT_IN_PLACE, top_k=2, reason="test table"))
    sess = session_of(FRAME, booking("ON TIME"))
    p = plan_request(req(FRAME, booking("CANCELLED"), session="agent-17"), TierView(), sess, encode, cfg)
    (step,) = p.steps
    assert step.kind is PlanKind.EDIT_IN_PLACE and step.field_span == (3 + 2, 3 + 4) and step.top_k == 2
    assert step.token_ids[:5] == (1, 2, 3, 50, 51) and step.token_ids[5:6] == tuple(encode("CANCELLED"))
    # after an erratum the spans no longer match the cache: erratum again, with a note
    p2 = plan_request(req(FRAME, booking("CANCELLED"), session="agent-17"), TierView(),
                      dataclasses.replace(sess, errata=1), encode, cfg)
    assert p2.steps[-1].kind is PlanKind.ERRATUM and any("erratum instead" in n for n in p2.notes)


def test_caller_can_ask_for_an_erratum_or_edit_in_place():
    sess = session_of(FRAME, booking("ON TIME"))
    prefers_edit = PlannerConfig(edit=EditChoice(PlanKind.EDIT_IN_PLACE, top_k=4, reason="table"))
    r = dataclasses.replace(req(FRAME, booking("CANCELLED"), session="agent-17"), edit_strategy="erratum")
    p = plan_request(r, TierView(), sess, encode, prefers_edit)
    assert p.steps[-1].kind is PlanKind.ERRATUM and "requested" in p.steps[-1].reason
    r = dataclasses.replace(r, edit_strategy="edit_in_place")
    assert plan_request(r, TierView(), sess, encode).steps[0].kind is PlanKind.EDIT_IN_PLACE
    with pytest.raises(ValueError):
        plan_request(dataclasses.replace(r, edit_strategy="magic"), TierView(), sess, encode)


def test_different_segments_fall_back_to_per_segment_planning():
    sess = session_of(FRAME, SKILL)
    p = plan_request(req(FRAME, MEM, session="agent-17"), TierView(frozenset({MEM.kv.digest})), sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.RECOMPUTE, PlanKind.REPOSITION]
    assert any("different segments" in n for n in p.notes)


def test_plain_prompt_prefix_reuse():
    prompt = RenderedSegment("prompt", None, tuple(range(300)))
    p = plan_request(req(prompt, policy=Policy.EXACT), TierView(prompt_prefix_hit=300, prompt_prefix_kv=CTX), None, encode)
    assert p.steps[0].kind is PlanKind.REUSE and p.steps[0].reused == 300 and len(p.steps) == 1
    part = plan_request(req(prompt), TierView(prompt_prefix_hit=256, prompt_prefix_kv=CTX), None, encode)
    assert [(s.kind, s.tokens, s.position) for s in part.steps] == [(PlanKind.REUSE, 256, 0), (PlanKind.RECOMPUTE, 44, 256)]


def test_plan_is_frozen_and_empty_request_rejected():
    p = plan_request(req(FRAME), TierView(), None, encode)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.steps = ()
    with pytest.raises(ValueError):
        plan_request(req(suffix=()), TierView(), None, encode)


def test_choose_edit_kind_reads_the_fidelity_table():
    assert choose_edit_kind(None).kind is PlanKind.ERRATUM
    table = {"edit_informative": {
        "erratum: correction": {"n": 10, "greedy_exact": 0.3, "top1": 0.6, "kl_mean": 0.2},
        "field + top-16": {"n": 10, "greedy_exact": 0.8, "top1": 0.9, "kl_mean": 0.01}}}
    c = choose_edit_kind(table)
    assert c.kind is PlanKind.EDIT_IN_PLACE and c.top_k == 16 and "10 informative" in c.reason
    table["edit_informative"]["erratum: correction"]["greedy_exact"] = 0.9
    assert choose_edit_kind(table).kind is PlanKind.ERRATUM
