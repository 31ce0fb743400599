"""The planner is a pure function: these tests need no model, no Ray, no I/O."""
import dataclasses

import pytest

from kvruntime.messages.plan import KVRef, PlanKind, Policy
from cluster.control.planner import (EditChoice, PlannerConfig, RenderedRequest, RenderedSegment, SessionContext,
                             TierView, choose_edit_kind, frame_variant, plan_request)


def encode(text):          # stands in for a tokenizer: one id per word
    return [len(w) for w in text.split()]


FRAME = RenderedSegment("frame", None, (1, 2, 3))
SALT = "ab" * 16
SKILL = RenderedSegment("skill", "refund-policy", tuple(range(100, 140)), kv=KVRef(tuple(range(100, 140)), 1, SALT))
MEM = RenderedSegment("memory", "user-42", tuple(range(200, 230)), kv=KVRef(tuple(range(200, 230)), 1, SALT))
CTX = KVRef((1, 2, 3), 0, SALT)
TXT = RenderedSegment("text", None, (70, 71))     # text between the frame and a chunk: the chunk is not first


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
    fast = plan_request(req(FRAME, TXT, SKILL, MEM), tier, None, encode)
    assert [s.kind for s in fast.steps] == [PlanKind.RECOMPUTE, PlanKind.RECOMPUTE, PlanKind.REPOSITION,
                                            PlanKind.REPOSITION]
    rep, warm = fast.steps[2], fast.steps[3]
    assert rep.position == 5 and rep.seam_tokens == 1 and rep.computed == 1 and rep.reused == 39 and rep.kv == SKILL.kv
    assert warm.computed == 30 and warm.reused == 0 and warm.kv == MEM.kv and "re-warmed" in warm.reason
    assert any("user-42 is not in the tier: re-warmed" in n for n in fast.notes)
    assert fast.approx and len(fast.approx) == 32
    exact = plan_request(req(FRAME, TXT, SKILL, policy=Policy.EXACT), tier, None, encode)
    assert [s.kind for s in exact.steps] == [PlanKind.RECOMPUTE] * 3
    assert exact.reused_tokens == 0 and exact.kind is PlanKind.RECOMPUTE
    assert fast.kind is PlanKind.REPOSITION and fast.prompt_tokens == 3 + 2 + 40 + 30 + 3
    assert exact.approx == ""                     # recompute only: exact KV, storable for exact sessions


@pytest.mark.parametrize("policy", [Policy.EXACT, Policy.BALANCED, Policy.FAST])
def test_the_frame_and_the_first_chunk_are_one_exact_reuse_of_their_variant_under_every_policy(policy):
    """The chat frame and the chunk that comes first after it are planned as one exact reuse step
    from position 0 of their variant compiled together (KVRef of frame + chunk ids, prefix ()):
    the frame is never a forward pass once the variant is in the tier. The chunk after it keeps
    the policy's rule (exact: recompute; balanced without a profile row meeting the target:
    recompute; fast: reposition)."""
    variant = KVRef(FRAME.token_ids + SKILL.token_ids, 0, SALT, prefix=())
    assert variant.digest != SKILL.kv.digest and frame_variant((FRAME, SKILL, MEM)) == variant
    assert variant.digest != KVRef(variant.token_ids, 0, SALT).digest     # not a plain prompt prefix's key
    assert frame_variant((FRAME, TXT, SKILL)) is None and frame_variant((FRAME,)) is None
    tier = TierView(frozenset({SKILL.kv.digest, MEM.kv.digest, variant.digest}))
    no_row = PlannerConfig(balanced=ComposeChoice(False, reason="no compose operation meets top1 >= 97%"))
    p = plan_request(req(FRAME, SKILL, MEM, policy=policy), tier, None, encode, no_row)
    assert len(p.steps) == 2 and p.prefix_ids == FRAME.token_ids + SKILL.token_ids + MEM.token_ids
    first, second = p.steps
    assert first.kind is PlanKind.REUSE and first.kv == variant and not first.approximate
    assert first.source == "frame+skill:refund-policy" and first.token_ids == variant.token_ids
    assert (first.position, first.computed, first.reused) == (0, 0, 43)
    assert "chat frame (3 tokens) + skill:refund-policy compiled together: exact" in first.reason
    assert "no frame forward pass" in p.explain()["steps"][0]["reason"]
    later = {Policy.EXACT: PlanKind.RECOMPUTE, Policy.BALANCED: PlanKind.RECOMPUTE, Policy.FAST: PlanKind.REPOSITION}
    assert second.kind is later[policy] and second.kv in (None, MEM.kv) and second.position == 43
    alone = plan_request(req(FRAME, SKILL, policy=policy), tier, None, encode, no_row)
    assert alone.approx == "" and alone.kind is PlanKind.REUSE and alone.reused_tokens == 43
    assert alone.computed_tokens == 3                                        # the question only
    # not in the tier yet: still exact reuse, compiled by the prefill worker on first use (noted)
    cold = plan_request(req(FRAME, SKILL, policy=policy), TierView(), None, encode, no_row)
    assert cold.steps[0].kind is PlanKind.REUSE and cold.steps[0].kv == variant and cold.steps[0].computed == 43
    assert "first use" in cold.steps[0].reason and any("compiled on first use" in n for n in cold.notes)
    # another frame (another system prompt) is another variant
    other = RenderedSegment("frame", None, (1, 2, 4, 5))
    assert plan_request(req(other, SKILL, policy=policy), tier, None, encode, no_row).steps[0].kv.digest \
        not in (variant.digest, SKILL.kv.digest)


def test_exact_never_reuses_an_approximate_session_context():
    approx_sess = session_of(FRAME, SKILL, booking("ON TIME"), approx="c0ffee")
    p = plan_request(req(FRAME, SKILL, booking("ON TIME"), policy=Policy.EXACT, session="agent-17"), TierView(),
                     approx_sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE]   # frame + skill variant
    assert not any(s.approximate for s in p.steps) and p.approx == ""
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
    """No answer-level edit rows (no profile section edit_answers): balanced recomputes, and the
    note says which row is missing; exact never edits."""
    sess = session_of(FRAME, booking("ON TIME"))
    for policy, why in ((Policy.BALANCED, "no answer-level profile row for edit_in_place"),
                        (Policy.EXACT, "policy exact: erratum is not bit-identical")):
        p = plan_request(req(FRAME, booking("CANCELLED"), policy=policy, session="agent-17"), TierView(), sess, encode)
        assert {s.kind for s in p.steps} == {PlanKind.RECOMPUTE}
        assert any(f"1 field edit(s) under policy {policy.value}: recomputed" in n and why in n for n in p.notes), p.notes


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
    sess = session_of(FRAME, TXT, SKILL)
    p = plan_request(req(FRAME, TXT, MEM, session="agent-17"), TierView(frozenset({MEM.kv.digest})), sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.RECOMPUTE, PlanKind.RECOMPUTE, PlanKind.REPOSITION]
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
    c = choose_edit_kind(table)             # neither meets top-1 >= 95%: the most faithful
    assert c.kind is PlanKind.EDIT_IN_PLACE and c.top_k == 16 and "10 informative" in c.reason
    assert "none meets" in c.reason
    table["edit_informative"]["erratum: correction"]["greedy_exact"] = 0.9
    assert choose_edit_kind(table).kind is PlanKind.ERRATUM


def test_choose_edit_kind_takes_the_cheapest_operation_that_meets_the_target():
    ok = {"n": 20, "greedy_exact": 0.9, "top1": 0.97, "kl_mean": 0.01}
    table = {"edit_informative": {"erratum: correction": {**ok, "seconds_mean": 0.05, "recomputed_tokens_mean": 40},
                                  "field + top-16": {**ok, "greedy_exact": 1.0, "top1": 1.0, "seconds_mean": 0.30,
                                                     "recomputed_tokens_mean": 30}}}
    c = choose_edit_kind(table, min_top1=0.95)      # both meet it: the erratum costs 6x less, measured
    assert c.kind is PlanKind.ERRATUM and c.top_k == 0 and "measured time" in c.reason and "50 ms" in c.reason
    # the erratum below the target: edit-in-place, however cheap the erratum is
    assert choose_edit_kind(table, min_top1=0.98).kind is PlanKind.EDIT_IN_PLACE
    # no timings (a table from before they were measured): the tokens each computes, said so
    for s in table["edit_informative"].values():
        s["seconds_mean"] = float("nan")
    c = choose_edit_kind(table, min_top1=0.95)
    assert c.kind is PlanKind.EDIT_IN_PLACE and "no timings" in c.reason


def test_the_shipped_models_edit_in_place_because_the_erratum_misses_their_target():
    from kvruntime.fidelity.profiles import load_summary
    for model in ("smollm2-135m", "gemma3-270m"):
        c = choose_edit_kind(load_summary(model), min_top1=0.95)
        assert c.kind is PlanKind.EDIT_IN_PLACE, (model, c.reason)
        assert "erratum: correction: top-1" in c.reason


# ---- fidelity-targeted composition --------------------------------------------------------------
from cluster.control.planner import (ComposeChoice, FidelityTarget, answer_criteria, choose_compose,  # noqa: E402
                                     compose_op_key, executable_probe)


def _row(top1, n=12, seam=1, r=0.0, rotate=True, **extra):
    return {"n": n, "top1": top1, "greedy_exact": extra.get("greedy_exact", 0.2), "kl_mean": 0.1,
            "params": {"rotate": rotate, "seam_tokens": seam, "recompute_ratio": r}}


def _profile(sweep: dict, compose: dict | None = None):
    return {"compose": compose or {}, "compose_sweep": {"meta": {}, "ops": sweep}}


BALANCED = FidelityTarget("top1", 0.97)


def test_a_row_just_under_the_target_misses_and_explain_does_not_round_it_up():
    """87/90 = 96.7% misses top-1 >= 97% (compared exactly), and a met 97.5% is cited as such."""
    miss = choose_compose(_profile({"r50": _row(87 / 90, n=90, r=0.5)}), BALANCED, model="m")
    assert not miss.allowed and "top1 >= 97%" in miss.reason
    hit = choose_compose(_profile({"r50": _row(87 / 90, n=90, r=0.5), "r60": _row(0.975, n=90, r=0.6)}),
                         BALANCED, model="m")
    assert hit.allowed and hit.recompute_ratio == 0.6 and "top1 97.5% on 90 cases" in hit.reason


def test_balanced_picks_the_cheapest_operation_whose_profile_meets_the_target():
    prof = _profile({"seam": _row(0.86), "r5": _row(0.92, r=0.05), "r15": _row(0.97, r=0.15),
                     "r50": _row(1.0, r=0.5)},
                    compose={"naive": _row(0.99, n=66, seam=0, rotate=False), "seam4": _row(0.96, n=66, seam=4)})
    c = choose_compose(prof, BALANCED, model="m")
    assert c.allowed and (c.seam_tokens, c.recompute_ratio) == (1, 0.15) and c.op == compose_op_key(1, 0.15)
    assert "compose_sweep row 'r15': top1 97% on 12 cases" in c.reason
    tier = TierView(frozenset({SKILL.kv.digest}))
    plan = plan_request(req(FRAME, TXT, SKILL, policy=Policy.BALANCED), tier, None, encode, PlannerConfig(balanced=c))
    step = plan.steps[2]
    assert step.kind is PlanKind.REPOSITION and step.recompute_ratio == 0.15 and step.seam_tokens == 1
    assert step.computed == 1 + 6 and step.reused == 40 - 7                # ceil(0.15 * 39) = 6
    assert "r15" in plan.explain()["steps"][2]["reason"] and plan.explain()["steps"][2]["recompute_ratio"] == 0.15
    same = plan_request(req(FRAME, TXT, SKILL, policy=Policy.BALANCED), tier, None, encode,
                        PlannerConfig(balanced=ComposeChoice(True, 1, 0.5, compose_op_key(1, 0.5))))
    assert same.approx != plan.approx                                       # a different recipe, a different tag


def test_balanced_never_picks_an_operation_whose_profile_misses_the_target():
    import random
    rng = random.Random(7)
    for _ in range(300):
        sweep = {f"op{i}": _row(rng.choice([0.8, 0.9, 0.96, 0.97, 0.99, 1.0]), n=rng.choice([5, 12, 66]),
                                seam=rng.choice([0, 1, 4]), r=rng.choice([0.0, 0.05, 0.1, 0.25, 0.5]))
                 for i in range(rng.randint(0, 6))}
        c = choose_compose(_profile(sweep), BALANCED)
        rows_of = lambda s, r: [x for x in sweep.values() if (x["params"]["seam_tokens"], x["params"]["recompute_ratio"]) == (s, r)]  # noqa: E731
        meets = lambda rows: bool(rows) and all(x["top1"] >= 0.97 and x["n"] >= 10 for x in rows)  # noqa: E731
        if c.allowed:
            assert meets(rows_of(c.seam_tokens, c.recompute_ratio))
            cheaper = {(x["params"]["seam_tokens"], x["params"]["recompute_ratio"]) for x in sweep.values()
                       if (x["params"]["recompute_ratio"], x["params"]["seam_tokens"]) < (c.recompute_ratio, c.seam_tokens)}
            assert not any(meets(rows_of(*k)) for k in cheaper)
        else:
            assert not any(meets(rows_of(x["params"]["seam_tokens"], x["params"]["recompute_ratio"])) for x in sweep.values())


def test_rows_measured_with_a_probe_the_executors_do_not_run_are_not_used():
    """A sweep row for another probe (e.g. progressive) says nothing about what an executor runs."""
    fancy = _row(1.0, r=0.1)
    fancy["params"]["probe"] = "progressive"
    prof = _profile({"seam": _row(0.9), "r10 progressive": fancy, "r50": _row(0.98, r=0.5)})
    c = choose_compose(prof, BALANCED)
    assert c.allowed and c.recompute_ratio == 0.5 and "progressive" not in c.reason
    prof = _profile({"seam": _row(0.9), "r10 progressive": fancy})
    assert not choose_compose(prof, BALANCED).allowed


def test_a_model_without_a_profile_gets_only_exact_reuse():
    c = choose_compose(None, BALANCED)
    assert not c.allowed and "no fidelity profile" in c.reason
    tier = TierView(frozenset({SKILL.kv.digest}))
    for pol in (Policy.BALANCED, Policy.FAST):
        plan = plan_request(req(FRAME, TXT, SKILL, policy=pol), tier, None, encode, PlannerConfig(balanced=c, fast=c))
        assert [s.kind for s in plan.steps] == [PlanKind.RECOMPUTE] * 3 and plan.approx == ""
        assert "no fidelity profile" in plan.steps[2].reason


def test_a_demoted_operation_is_skipped_until_it_recovers():
    prof = _profile({"seam": _row(0.98), "r10": _row(0.99, r=0.1)})
    assert choose_compose(prof, BALANCED).op == compose_op_key(1, 0.0)
    c = choose_compose(prof, BALANCED, demoted=frozenset({compose_op_key(1, 0.0)}))
    assert c.op == compose_op_key(1, 0.1) and "demoted online: reposition(seam=1,r=0)" in c.reason
    none = choose_compose(prof, BALANCED, demoted=frozenset({compose_op_key(1, 0.0), compose_op_key(1, 0.1)}))
    assert not none.allowed and "demoted" in none.reason


def _shipped_rows(prof):
    return [(sec, name, r) for sec, rows in (("compose", prof.get("compose", {})),
                                             ("compose_sweep", prof.get("compose_sweep", {}).get("ops", {})))
            for name, r in rows.items() if r.get("params", {}).get("rotate")
            and executable_probe(r["params"].get("probe", "kv1")) and not r["params"].get("recompute")]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_shipped_profiles_are_read_and_balanced_never_picks_a_row_that_misses_the_target(model):
    """Against the profiles the cluster ships (kvruntime/fidelity/tables/<model>.json, whatever
    they currently measure): the choice under ``balanced`` meets the target on every row of its
    operation (>= 10 cases), no cheaper operation does, and ``explain`` quotes the row(s)."""
    from kvruntime.fidelity.report import load_summary
    prof = load_summary(model)
    assert prof and prof.get("compose_sweep", {}).get("ops"), model
    rows = _shipped_rows(prof)
    key = lambda r: (r["params"]["seam_tokens"], r["params"]["recompute_ratio"])  # noqa: E731
    by_op: dict = {}
    for sec, name, r in rows:
        by_op.setdefault(key(r), []).append((sec, name, r))
    meets = {k: all(r["top1"] >= 0.97 and r["n"] >= 10 for _, _, r in v) for k, v in by_op.items()}
    c = choose_compose(prof, BALANCED, model=model)
    tier = TierView(frozenset({SKILL.kv.digest}))
    plan = plan_request(req(FRAME, TXT, SKILL, policy=Policy.BALANCED), tier, None, encode, PlannerConfig(balanced=c))
    reason = plan.explain()["steps"][2]["reason"]
    if c.allowed:
        chosen = (c.seam_tokens, c.recompute_ratio)
        assert meets[chosen], (model, c)
        assert not any(ok for k, ok in meets.items() if (k[1], k[0]) < (chosen[1], chosen[0])), (model, c)
        assert plan.steps[2].kind is PlanKind.REPOSITION and plan.steps[2].recompute_ratio == c.recompute_ratio
        for sec, name, r in by_op[chosen]:       # explain cites every row of the chosen operation
            assert f"{model} {sec} row '{name}': top1 {r['top1']:.0%} on {r['n']} cases" in reason, reason
    else:
        assert not any(meets.values()), (model, meets)
        assert plan.steps[2].kind is PlanKind.RECOMPUTE
        assert f"no compose operation in the {model}'s fidelity profile meets top1 >= 97%" in reason, reason


# ---- balanced's answer target (section compose_answers) ---------------------------------------
ANSWERS = FidelityTarget.answers()


def _arow(top1=0.97, n=130, dec=1.0, dn=40, bound=0.01, an=130, r=0.1, probe="kv1", compile="bos", seam=1, ms=100.0):
    from kvruntime.fidelity.report import wilson
    return {"params": {"compile": compile, "rotate": True, "seam_tokens": seam, "recompute_ratio": r, "probe": probe},
            "n": n, "top1": top1, "top1_ci": list(wilson(round(top1 * n), n)), "decision_n": dn, "decision": dec,
            "decision_ci": list(wilson(round(dec * dn), dn)) if dn else None, "answered": an, "accuracy": 0.5,
            "accuracy_recompute": 0.5, "drop_bound": bound, "ms_per_request": ms}


def _aprof(ops):
    return {"compose_answers": {"meta": {}, "ops": ops}}


def test_the_answer_target_needs_every_criterion_on_enough_cases():
    """Each criterion alone keeps an operation out; so do too few cases of any kind. The counts
    come from the config (BALANCED_MIN_CASES): 30 cases, 30 judged answers, 20 decision cases."""
    from kvruntime.config import BALANCED_MIN_CASES, ClusterConfig
    assert (ANSWERS.min_cases, ANSWERS.min_answered, ANSWERS.min_decisions) == tuple(BALANCED_MIN_CASES.values())
    assert FidelityTarget.from_config(ClusterConfig()) == ANSWERS
    assert ANSWERS.basis == "answers" and (ANSWERS.minimum, ANSWERS.max_drop, ANSWERS.min_decision,
                                           ANSWERS.max_ratio) == (0.95, 0.02, 0.98, 0.10)
    assert choose_compose(_aprof({"ok": _arow()}), ANSWERS).allowed
    for bad in (dict(top1=0.94), dict(dec=0.97), dict(bound=0.021), dict(r=0.15), dict(n=29), dict(an=29),
                dict(dn=19), dict(dec=None, dn=0), dict(bound=None, an=0)):
        c = choose_compose(_aprof({"op": _arow(**bad)}), ANSWERS, model="m")
        assert not c.allowed and "nearest op" in c.reason, bad
    with pytest.raises(ValueError):
        ClusterConfig.of(balanced_min_decision=1.5)


def test_balanced_by_answers_picks_the_cheapest_row_that_meets_it_and_cites_its_intervals():
    prof = _aprof({"bos | seam 1": _arow(top1=0.9, r=0.0), "bos | kv1 10%": _arow(ms=200.0),
                   "bos | qlate 10%": _arow(probe="qlate", ms=150.0), "bos | kv1 5%": _arow(r=0.05, dec=0.95),
                   "frame | kv1 5%": _arow(r=0.05, compile="frame")})
    c = choose_compose(prof, ANSWERS, model="m")
    row = prof["compose_answers"]["ops"]["bos | qlate 10%"]
    assert c.allowed and (c.seam_tokens, c.recompute_ratio, c.probe) == (1, 0.1, "qlate")   # cheaper in ms
    assert c.op == compose_op_key(1, 0.1, "qlate") == "reposition(seam=1,r=0.1,probe=qlate)"
    lo, hi = row["top1_ci"]
    assert f"'bos | qlate 10%': top-1 agreement 97% [{lo * 100:.0f}-{hi * 100:.0f}%] on 130 cases" in c.reason
    assert f"accuracy drop <= {row['drop_bound'] * 100:.1f} points (95% bound" in c.reason
    tier = TierView(frozenset({SKILL.kv.digest}))
    plan = plan_request(req(FRAME, TXT, SKILL, policy=Policy.BALANCED), tier, None, encode, PlannerConfig(balanced=c))
    step = plan.steps[2]
    assert step.kind is PlanKind.REPOSITION and step.probe == "qlate" and step.recompute_ratio == 0.1
    assert "picked by the question" in step.reason and "answer target met" in step.reason
    demoted = choose_compose(prof, ANSWERS, demoted=frozenset({c.op}))
    assert demoted.op == compose_op_key(1, 0.1) and demoted.probe == "kv1" and "demoted online" in demoted.reason


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_shipped_profiles_explain_balanced_by_answers_with_the_profiles_numbers(model):
    """On the shipped profiles (compose_answers from the measured rows in kvruntime/fidelity/tables/rows/) balanced is allowed only
    if a planned row meets every criterion; otherwise the reason names the nearest candidate and
    quotes, from the profile, each criterion it missed with its interval and case count."""
    from kvruntime.fidelity.report import load_summary
    prof = load_summary(model)
    ops = prof["compose_answers"]["ops"]
    planned = {k: v for k, v in ops.items() if v["params"].get("compile") == "bos" and not v["params"].get("recompute")}
    assert planned, model
    meets = {k: all(ok for ok, _, _ in answer_criteria(v, ANSWERS)) for k, v in planned.items()}
    c = choose_compose(prof, ANSWERS, model=model)
    tier = TierView(frozenset({SKILL.kv.digest}))
    plan = plan_request(req(FRAME, TXT, SKILL, policy=Policy.BALANCED), tier, None, encode, PlannerConfig(balanced=c))
    reason = plan.explain()["steps"][2]["reason"]
    if c.allowed:
        name = next(k for k, v in planned.items() if compose_op_key(1, v["params"]["recompute_ratio"],
                                                                    v["params"]["probe"]) == c.op and meets[k])
        assert f"row '{name}'" in reason
        return
    assert not any(meets.values()) and plan.steps[2].kind is PlanKind.RECOMPUTE
    assert f"no operation in the {model}'s profile meets the answer target; nearest " in reason, reason
    name = reason.split("nearest ", 1)[1].split(": ", 1)[0]
    row = planned[name]
    missed = [t for ok, _, t in answer_criteria(row, ANSWERS) if not ok]
    assert missed and all(t in reason for t in missed)
    if row["top1"] < 0.95:
        lo, hi = row["top1_ci"]
        assert (f"top-1 agreement {row['top1']:.1%}".replace(".0%", "%") in reason
                and f"[{lo * 100:.0f}-{hi * 100:.0f}%] on {row['n']} cases (needs >= 95%)" in reason), reason
    if row["drop_bound"] is not None and row["drop_bound"] > 0.02:
        assert f"accuracy drop <= {row['drop_bound'] * 100:.1f} points (95% bound, needs <= 2" in reason, reason
    others = [v for k, v in planned.items() if k != name]
    n_missed = len(missed)
    assert all(sum(1 for ok, _, _ in answer_criteria(v, ANSWERS) if not ok) >= n_missed for v in others)


def test_question_probe_rows_are_planned_and_other_probes_are_not():
    assert executable_probe("kv1") and executable_probe("qlate") and executable_probe("q3-g1")
    assert not executable_probe("progressive") and not executable_probe("kv4") and not executable_probe("qnope")
    q = _row(0.98, r=0.1)
    q["params"]["probe"] = "qlast"
    c = choose_compose(_profile({"seam": _row(0.9), "r10 qlast": q, "r50": _row(0.99, r=0.5)}), BALANCED)
    assert c.allowed and (c.recompute_ratio, c.probe) == (0.1, "qlast") and c.op == compose_op_key(1, 0.1, "qlast")


def test_fidelity_target_validates():
    with pytest.raises(ValueError):
        FidelityTarget("cosine", 0.9)
    with pytest.raises(ValueError):
        FidelityTarget("top1", 1.5)


def test_a_cold_prompt_goes_whole_to_a_decode_engine_that_computes_it():
    """Decode engine vLLM: a request reusing nothing (and storing nothing for a session) has no
    prefix step, so no prefill worker runs and no KV travels; vLLM computes every token."""
    cold = PlannerConfig(decode_computes_cold=True)
    prompt = RenderedSegment("prompt", None, tuple(range(300)))
    p = plan_request(req(prompt), TierView(), None, encode, cold)
    assert p.steps == () and p.suffix_ids == tuple(range(300)) + (7, 8, 9) and p.prompt_tokens == 303
    assert p.kind is PlanKind.RECOMPUTE and p.computed_tokens == 303 and any("no KV transfer" in n for n in p.notes)
    # exact policy recomputes the skill too: still nothing reusable
    e = plan_request(req(FRAME, TXT, SKILL, policy=Policy.EXACT), TierView(frozenset({SKILL.kv.digest})), None,
                     encode, cold)
    assert e.steps == () and e.suffix_ids == FRAME.token_ids + TXT.token_ids + SKILL.token_ids + (7, 8, 9)
    # anything reusable keeps its prefill; a session's first turn keeps it (its context is stored)
    hit = plan_request(req(prompt), TierView(prompt_prefix_hit=256, prompt_prefix_kv=CTX), None, encode, cold)
    assert [s.kind for s in hit.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE]
    comp = plan_request(req(FRAME, TXT, SKILL), TierView(frozenset({SKILL.kv.digest})), None, encode, cold)
    assert [s.kind for s in comp.steps] == [PlanKind.RECOMPUTE, PlanKind.RECOMPUTE, PlanKind.REPOSITION]
    first = plan_request(req(FRAME, SKILL, policy=Policy.EXACT), TierView(), None, encode, cold)
    assert [s.kind for s in first.steps] == [PlanKind.REUSE]     # exact reuse (frame + skill) keeps its prefill
    first_turn = plan_request(req(FRAME, session="agent-17"), TierView(), None, encode, cold)
    assert [s.kind for s in first_turn.steps] == [PlanKind.RECOMPUTE]
    # the reference decode engine (default) keeps the prefill worker's recompute
    assert plan_request(req(prompt), TierView(), None, encode).steps[0].kind is PlanKind.RECOMPUTE


def test_a_held_exact_context_is_reused_whole_under_every_policy():
    ids = tuple(t for s in (FRAME, TXT, SKILL, MEM) for t in s.token_ids)
    exact = KVRef(ids, 0, SALT)
    tier = TierView(frozenset({SKILL.kv.digest, MEM.kv.digest}), held_context=exact)
    for policy in Policy:
        p = plan_request(req(FRAME, TXT, SKILL, MEM, policy=policy), tier, None, encode)
        assert [s.kind for s in p.steps] == [PlanKind.REUSE] and p.steps[0].kv == exact, policy
        assert p.prefix_ids == ids and p.reused_tokens == len(ids) and not p.approx and "held" in p.steps[0].reason
    # approximate KV (an earlier fast plan's recipe) is never read by an exact request
    approx = TierView(tier.chunk_keys, held_context=KVRef(ids, 0, SALT, "recipe-1"))
    assert plan_request(req(FRAME, TXT, SKILL, MEM, policy=Policy.FAST), approx, None, encode).steps[0].kv.approx
    assert len(plan_request(req(FRAME, TXT, SKILL, MEM, policy=Policy.EXACT), approx, None, encode).steps) > 1
    # other tokens: planned per segment as before
    other = TierView(tier.chunk_keys, held_context=KVRef(ids[:-1], 0, SALT))
    assert len(plan_request(req(FRAME, TXT, SKILL, MEM), other, None, encode).steps) > 1
    # a session's first turn reuses the held exact context too (fast used to compose it again)
    first = plan_request(req(FRAME, TXT, SKILL, MEM, session="s1"), tier, None, encode)
    assert [s.kind for s in first.steps] == [PlanKind.REUSE] and first.steps[0].kv == exact
    # an approximate held context is not read inside a session
    assert len(plan_request(req(FRAME, TXT, SKILL, MEM, session="s1"), approx, None, encode).steps) > 1


# ---- the longest exact prefix first, under every policy ---------------------------------------------
@pytest.mark.parametrize("policy", list(Policy))
def test_a_held_exact_prefix_longer_than_the_frame_variant_is_reused_first(policy):
    """A native context whose first 300 tokens the tier holds exactly (the prompt index) reuses
    them under every policy, before anything is composed: the segment the prefix ends inside is
    computed from there, later chunks planned by the segment rules."""
    big = RenderedSegment("skill", "big", tuple(range(1000, 1400)), kv=KVRef(tuple(range(1000, 1400)), 1, SALT))
    ctx = (FRAME, big, TXT, SKILL)
    ids = tuple(t for s in ctx for t in s.token_ids)
    variant = frame_variant(ctx)
    keys = frozenset({SKILL.kv.digest})            # the variant is not held: it would be compiled
    held = KVRef(ids[:300], 0, SALT)
    p = plan_request(req(*ctx, policy=policy), TierView(keys, prompt_prefix_hit=300, prompt_prefix_kv=held), None,
                     encode)
    assert p.steps[0].kind is PlanKind.REUSE and p.steps[0].kv == held and p.steps[0].tokens == 300
    assert p.steps[1].kind is PlanKind.RECOMPUTE and p.steps[1].position == 300 and p.steps[1].source == "skill:big"
    assert p.prefix_ids == ids
    last = p.steps[-1]
    assert last.source == "skill:refund-policy" and last.kind is (PlanKind.RECOMPUTE if policy is Policy.EXACT
                                                                     else PlanKind.REPOSITION)
    # a held variant longer than the prefix wins (exact too, more tokens)
    keys = keys | {variant.digest}
    short = plan_request(req(*ctx, policy=policy), TierView(keys, prompt_prefix_hit=300,
                                                            prompt_prefix_kv=held), None, encode)
    assert short.steps[0].kv == variant and short.steps[0].tokens == len(FRAME.token_ids) + 400


def test_a_held_exact_context_beats_an_edit_of_the_session_context():
    """fast, a session whose template field changed: the tier holds the new context exactly (an
    earlier request computed it), so it is reused whole instead of an erratum or edit on the old one."""
    sess = session_of(FRAME, SKILL, booking("ON TIME"))
    new = req(FRAME, SKILL, booking("CANCELLED"), session="agent-17")
    ids = tuple(t for s in new.context for t in s.token_ids)
    p = plan_request(new, TierView(held_context=KVRef(ids, 0, SALT)), sess, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE] and p.steps[0].kv.token_ids == ids and not p.approx
    assert any("held exactly" in n for n in p.notes)
    # the session's own exact context unchanged is still reused as it is
    same = plan_request(req(FRAME, SKILL, booking("ON TIME"), session="agent-17"),
                        TierView(held_context=KVRef(sess.token_ids, 0, SALT)), sess, encode)
    assert same.steps[0].kv == sess.context


# ---- balanced edits by measurement ---------------------------------------------------------------
def edit_row(n=65, top1=1.0, answered=32, right=20, right_ref=20, lost=0, dec_n=33, dec=1.0, inf_n=20, inf_top1=1.0):
    from kvruntime.fidelity.method_stats import newcombe_paired_upper
    gained = right - right_ref + lost
    a = right_ref - lost
    return {"n": n, "top1": top1, "top1_k": round(top1 * n), "top1_ci": [0.9, 1.0], "decision_n": dec_n,
            "decision": dec, "decision_ci": [0.9, 1.0], "answered": answered, "accuracy": right / answered,
            "accuracy_recompute": right_ref / answered,
            "drop_bound": newcombe_paired_upper(a, lost, gained, answered - a - lost - gained),
            "informative_n": inf_n, "informative_top1": inf_top1, "informative_top1_k": round(inf_top1 * inf_n),
            "informative_top1_ci": [0.8, 1.0]}


def edit_profile(eip=None, err=None):
    ops = {}
    if eip is not None:
        ops["field + top-16"] = {"params": {"edit": "edit_in_place", "top_k": 16}, **eip}
    if err is not None:
        ops["erratum: correction"] = {"params": {"edit": "erratum"}, **err}
    return {"edit_answers": {"meta": {}, "ops": ops}}


def test_edits_are_approved_for_balanced_only_by_rows_meeting_the_answer_target():
    from cluster.control.planner import FidelityTarget, choose_edits_by_answers
    t = FidelityTarget.answers()
    eip, err = choose_edits_by_answers(edit_profile(edit_row(), edit_row(top1=0.8, lost=3, right=17)), t,
                                       model="m")
    assert eip.kind is PlanKind.EDIT_IN_PLACE and eip.allowed and "'field + top-16' meets" in eip.reason
    assert "top-1 agreement 100%" in eip.reason and "20/32 right vs recompute's 20/32" in eip.reason
    assert err.kind is PlanKind.ERRATUM and not err.allowed and "needs >= 95%" in err.reason
    # an operation that ignores the edit agrees on the uninformative cases: top-1 there is not enough
    stale_like = edit_row(top1=0.97, inf_top1=0.6)
    (v, _) = choose_edits_by_answers(edit_profile(stale_like), t)
    assert not v.allowed and "on 20 informative cases" in v.reason and "needs >= 95%" in v.reason
    # too few cases, or no section at all: not approved, and the reason says what to run
    (few, _) = choose_edits_by_answers(edit_profile(edit_row(n=12, answered=6, right=4, right_ref=4, dec_n=5, inf_n=4)), t)
    assert not few.allowed and "only 12 cases measured" in few.reason and "needs >= 10 informative" in few.reason
    assert all(not v.allowed and "--edits-only" in v.reason for v in choose_edits_by_answers({}, t))


def test_balanced_plans_a_session_edit_the_profile_approves_and_cites_the_row():
    from cluster.control.planner import FidelityTarget, choose_edits_by_answers
    verdicts = choose_edits_by_answers(edit_profile(edit_row(), edit_row(top1=0.8)), FidelityTarget.answers(),
                                       model="m")
    cfg = PlannerConfig(edit=EditChoice(PlanKind.ERRATUM, reason="cheapest"), balanced_edits=verdicts)
    sess = session_of(FRAME, booking("ON TIME"))
    p = plan_request(req(FRAME, booking("CANCELLED"), policy=Policy.BALANCED, session="agent-17"), TierView(), sess,
                     encode, cfg)
    (step,) = p.steps                          # the erratum (the table's pick) misses: edit-in-place meets it
    assert step.kind is PlanKind.EDIT_IN_PLACE and "'field + top-16' meets the answer target" in step.reason
    # the caller asking for the erratum under balanced: the profile does not approve it -> recomputed
    asked = dataclasses.replace(req(FRAME, booking("CANCELLED"), policy=Policy.BALANCED, session="agent-17"),
                                edit_strategy="erratum")
    p = plan_request(asked, TierView(), sess, encode, cfg)
    assert {s.kind for s in p.steps} == {PlanKind.RECOMPUTE}
    assert any("'erratum: correction' misses" in n for n in p.notes)
    # fast is unchanged: the table's pick, no profile gate
    fast = plan_request(req(FRAME, booking("CANCELLED"), session="agent-17"), TierView(), sess, encode, cfg)
    assert fast.steps[-1].kind is PlanKind.ERRATUM


# ---- a prompt equal to a held one except one span ---------------------------------------------------
HELD_IDS = tuple(range(1000, 1600))            # 600 tokens held at position 0


def held_edit(start=400, end=402, new=(7, 7, 7), **kw):
    from cluster.control.planner import HeldPromptEdit
    return HeldPromptEdit(KVRef(HELD_IDS, 0, SALT), start, end, tuple(new), where="message 2 (user), token 400", **kw)


def prompt_req(he, policy=Policy.FAST, strategy="auto"):
    seg = RenderedSegment("prompt", None, he.new_token_ids)
    return dataclasses.replace(req(seg, policy=policy), edit_strategy=strategy)


def test_a_held_prompt_edit_is_planned_in_place_under_fast_with_a_span_of_another_length():
    he = held_edit()
    cfg = PlannerConfig(edit=EditChoice(PlanKind.EDIT_IN_PLACE, top_k=16, reason="t"))
    p = plan_request(prompt_req(he), TierView(held_edit=he), None, encode, cfg)
    (step,) = p.steps
    assert step.kind is PlanKind.EDIT_IN_PLACE and step.kv == he.held and step.field_span == (400, 402)
    assert step.token_ids == he.new_token_ids and step.tokens == 601 and step.top_k == 16
    assert step.computed == 3 + 16 and step.reused == 600 - 2 - 16
    assert "message 2 (user), token 400" in step.reason and any("first divergence" in n for n in p.notes)
    assert p.approx                                # edited KV is approximate: stored under its recipe


def test_a_held_prompt_edit_under_exact_reuses_the_prefix_in_whole_pieces_and_recomputes_the_rest():
    he = held_edit()
    p = plan_request(prompt_req(he, Policy.EXACT), TierView(held_edit=he), None, encode)
    assert [(s.kind, s.position, s.tokens) for s in p.steps] == [(PlanKind.REUSE, 0, 256),
                                                                 (PlanKind.RECOMPUTE, 256, 601 - 256)]
    assert p.steps[0].kv == KVRef(HELD_IDS[:256], 0, SALT) and not p.approx
    assert any("edit-in-place not planned (policy exact" in n for n in p.notes)
    early = held_edit(start=100, end=101)          # inside the first piece: nothing exact to reuse
    p = plan_request(prompt_req(early, Policy.EXACT), TierView(held_edit=early), None, encode)
    assert [s.kind for s in p.steps] == [PlanKind.RECOMPUTE] and any("first 256-token piece" in n for n in p.notes)


def test_a_held_prompt_edit_under_balanced_follows_the_profile():
    from cluster.control.planner import FidelityTarget, choose_edits_by_answers
    he = held_edit()
    t = FidelityTarget.answers()
    yes = PlannerConfig(balanced_edits=choose_edits_by_answers(edit_profile(edit_row()), t, model="m"))
    p = plan_request(prompt_req(he, Policy.BALANCED), TierView(held_edit=he), None, encode, yes)
    assert [s.kind for s in p.steps] == [PlanKind.EDIT_IN_PLACE] and "meets the answer target" in p.steps[0].reason
    no = PlannerConfig(balanced_edits=choose_edits_by_answers(edit_profile(edit_row(top1=0.9)), t, model="m"))
    p = plan_request(prompt_req(he, Policy.BALANCED), TierView(held_edit=he), None, encode, no)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE]
    assert any("misses the answer target" in n and "top-1 agreement 90%" in n for n in p.notes)


def test_the_erratum_for_a_held_prompt_only_when_asked_and_worded_as_measured():
    he = held_edit(label="order status", old_text="OPEN", new_text="RESOLVED")
    p = plan_request(prompt_req(he, strategy="erratum"), TierView(held_edit=he), None, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.ERRATUM]
    assert p.steps[0].token_ids == HELD_IDS
    assert p.steps[1].token_ids == tuple(encode("\nCorrection: the order status is now RESOLVED.\n"))
    assert any("not this prompt" in n for n in p.notes)
    auto = plan_request(prompt_req(he), TierView(held_edit=he), None, encode)      # not asked: edited in place
    assert [s.kind for s in auto.steps] == [PlanKind.EDIT_IN_PLACE]
    bare = held_edit()                             # no label / text: no correction can be worded
    p = plan_request(prompt_req(bare, strategy="erratum"), TierView(held_edit=bare), None, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE] and any("no label" in n for n in p.notes)


def test_a_held_prompt_edit_that_deletes_the_span_or_does_not_match_the_prompt():
    gone = held_edit(new=())
    p = plan_request(prompt_req(gone), TierView(held_edit=gone), None, encode)
    assert [s.kind for s in p.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE] and any("deleted" in n for n in p.notes)
    he = held_edit()
    wrong = req(RenderedSegment("prompt", None, HELD_IDS))
    with pytest.raises(ValueError, match="does not describe this prompt"):
        plan_request(wrong, TierView(held_edit=he), None, encode)
    from cluster.control.planner import HeldPromptEdit
    with pytest.raises(ValueError, match="outside"):
        HeldPromptEdit(KVRef(HELD_IDS, 0, SALT), 10, 700, ())
