"""The answer-level edit rows (``kvruntime.fidelity.edit_answers``) from ``run_edit`` rows: counts,
intervals and the paired accuracy-drop bound, on hand-made rows (no model)."""
import math

import pytest

from kvruntime.fidelity.edit_answers import edit_answers_section
from kvruntime.fidelity.method_stats import newcombe_paired_upper
from kvruntime.fidelity.runner import REFERENCE_OP, edit_answers_of
from kvruntime.fidelity.cases import load_edit_cases

SHIPPED = ["smollm2-135m", "gemma3-270m"]
# what each shipped profile's edit_answers rows give balanced (docs/fidelity.md, "Field edits under balanced"):
# SmolLM2's edit-in-place misses on decision agreement (32/33) and the drop bound (one lost, one gained);
# Gemma-3's meets every part (65/65 top-1, 33/33 decisions, 20/32 vs 20/32); neither erratum row meets it
BALANCED_EDITS = {"smollm2-135m": {"edit_in_place": False, "erratum": False},
                  "gemma3-270m": {"edit_in_place": True, "erratum": False}}


def row(case, kind, top1, **kw):
    return {"case": case, "kind": kind, "top1": top1, "greedy_exact": top1, "kl": 0.01, "recomputed_tokens": 40,
            "context_tokens": 300, "seconds": 0.5, **kw}


def test_each_shipped_edit_case_is_judged_by_its_answer_or_its_decision():
    cases = load_edit_cases()
    judged = [edit_answers_of(c) for c in cases]
    assert all(bool(a) != yes_no for a, yes_no in judged)      # exactly one way per case
    assert sum(1 for a, _ in judged if a) >= 30 and sum(1 for _, y in judged if y) >= 20   # the target's power
    lookup = next(c for c in cases if c.kind == "lookup")
    assert edit_answers_of(lookup) == ((lookup.new,), False)


def test_the_section_pairs_answers_with_recompute_and_counts_informative_cases():
    ref, op = [], []
    for i in range(10):                            # lookups: recompute right on 8, the op loses one of them
        ref.append(row(f"l{i}", "lookup", 1.0, answer_ok=float(i < 8)))
        op.append(row(f"l{i}", "lookup", 1.0 if i else 0.0, answer_ok=float(1 <= i < 8)))
    for i in range(6):                             # yes/no: the op agrees on 5
        ref.append(row(f"d{i}", "derived", 1.0, decision="yes", decision_agree=1.0))
        op.append(row(f"d{i}", "derived", 1.0, decision="yes", decision_agree=float(i < 5)))
    informative = {r["case"]: r["case"] in ("l0", "l1", "d5") for r in ref}
    sec = edit_answers_section({REFERENCE_OP: ref, "field + top-16": op}, informative, {"model": "m"})
    r = sec["ops"]["field + top-16"]
    assert r["n"] == 16 and r["top1_k"] == 15 and r["answered"] == 10 and r["lost"] == 1 and r["gained"] == 0
    assert r["accuracy"] == pytest.approx(0.7) and r["accuracy_recompute"] == pytest.approx(0.8)
    assert r["drop_bound"] == pytest.approx(newcombe_paired_upper(7, 1, 0, 2))
    assert r["decision_n"] == 6 and r["decision_k"] == 5 and r["decision_ci"][0] < 5 / 6 < r["decision_ci"][1]
    assert r["informative_n"] == 3 and r["informative_top1_k"] == 2 and r["params"]["edit"] == "edit_in_place"
    assert sec["meta"]["cases"] == {"lookup": 10, "derived": 6, "informative": 3}
    assert not math.isnan(r["ms_per_request"])
    with pytest.raises(ValueError, match="reference=True"):
        edit_answers_section({"field + top-16": op}, informative, {})


@pytest.mark.parametrize("model", SHIPPED)
def test_the_shipped_edit_answers_are_what_the_committed_run_log_gives_and_the_planner_cites_them(model):
    """The shipped profile's ``edit_answers`` section is recomputed from its committed calibrate run
    log (docs/runs/calibrate_edits_2026-12-02/), and balanced's verdicts cite its rows."""
    import json
    from pathlib import Path

    from cluster.control.compose_choice import FidelityTarget, choose_edits_by_answers
    from kvruntime.fidelity.report import load_summary
    log = Path(__file__).parent.parent / "docs" / "runs" / "calibrate_edits_2026-12-02" / f"{model}.rows.jsonl"
    prof = load_summary(model)
    if "edit_answers" not in prof:
        pytest.fail(f"{model}: the shipped profile has no edit_answers section (kvnotes calibrate --edits-only)")
    rows, informative = {}, {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        informative[rec["case"]] = rec["informative"]
        for op, r in rec["rows"].items():
            rows.setdefault(op, []).append(r)
    again = edit_answers_section(rows, informative, {})
    shipped = prof["edit_answers"]
    assert shipped["meta"]["cases"] == again["meta"]["cases"] and shipped["meta"]["cases"]["lookup"] == 32
    for op, r in again["ops"].items():
        for k, v in r.items():
            want = shipped["ops"][op][k]
            assert (v == pytest.approx(want, nan_ok=True)) if isinstance(v, float) else v == want, (op, k)
    for v in choose_edits_by_answers(prof, FidelityTarget.answers(), model=model):
        assert v.row in shipped["ops"] and f"{model} edit_answers row '{v.row}'" in v.reason
        assert ("meets" if v.allowed else "misses") in v.reason


@pytest.mark.parametrize("model", SHIPPED)
def test_balanced_plans_a_held_prompt_edit_as_the_shipped_profile_says_and_explain_cites_the_row(model):
    """With the router's verdicts from the shipped profile, ``balanced`` plans an edit of a held
    prompt in place exactly where the profile's row meets the answer target, recomputes it where
    not, and ``explain`` (the plan's JSON) cites the row and its numbers either way; the erratum,
    asked for, is declined on both models with its row cited."""
    from cluster.control.compose_choice import FidelityTarget, choose_edits_by_answers
    from cluster.control.planner import (HeldPromptEdit, PlannerConfig, RenderedRequest, RenderedSegment, TierView,
                                         plan_request)
    from kvruntime.fidelity.report import load_summary
    from kvruntime.messages.plan import KVRef, PlanKind, Policy
    verdicts = choose_edits_by_answers(load_summary(model), FidelityTarget.answers(), model=model)
    assert {v.kind.value: v.allowed for v in verdicts} == BALANCED_EDITS[model]
    cfg = PlannerConfig(balanced_edits=verdicts)
    held = KVRef(tuple(range(1000, 1600)), 0, "e5" * 16)
    he = HeldPromptEdit(held, 400, 402, (7, 7, 7), where="message 2 (user), token 400", label="status",
                        old_text="OPEN", new_text="CLOSED")

    def explain(strategy):
        r = RenderedRequest("r1", model, Policy.BALANCED, (RenderedSegment("prompt", None, he.new_token_ids),), (13,),
                            edit_strategy=strategy)
        e = plan_request(r, TierView(held_edit=he), None, lambda t: [len(w) for w in t.split()], cfg).explain()
        return e, [s["kind"] for s in e["steps"]], " | ".join([s["reason"] for s in e["steps"]] + e["notes"])

    e, kinds, text = explain("auto")
    cited = f"{model} edit_answers row 'field + top-16'"
    if BALANCED_EDITS[model]["edit_in_place"]:
        assert kinds == ["edit_in_place"] and cited in e["steps"][0]["reason"] and not e["exact"]
        assert "meets the answer target" in e["steps"][0]["reason"] and "top-1 agreement 100%" in text
    else:
        assert kinds == ["reuse", "recompute"] and e["exact"]
        assert any(cited in n and "misses the answer target" in n and "decision agreement 97.0%" in n
                   for n in e["notes"]), e["notes"]
    e, kinds, text = explain("erratum")
    assert PlanKind.ERRATUM.value not in kinds and kinds == ["reuse", "recompute"]
    assert any(f"{model} edit_answers row 'erratum: correction' misses" in n for n in e["notes"]), e["notes"]
