"""The profile section ``edit_answers``: the field edits measured the way ``balanced`` measures
compositions (``compose_answers``), so the same answer-level target decides whether it may plan
them (``cluster.control.compose_choice.choose_edits_by_answers``).

Per planned edit operation (edit-in-place ``field + top-16``, the erratum ``erratum: correction``)
and the baseline that ignores the edit (``stale (no fix)``, never planned: it shows what an
operation must beat), on the edit cases (``kvruntime/evalsets/edit.jsonl``, rows from
``runner.run_edit(..., reference=True)``):

- top-1 and greedy-16 agreement with a full recompute of the edited notes, 95% Wilson intervals;
- answer accuracy on the lookup cases (the answer is the new value), paired with recompute's on
  the same cases, and the one-sided 95% upper bound of the accuracy drop (Newcombe, paired);
- yes/no decision agreement with recompute on the derived cases (each asks yes or no);
- the same top-1 agreement on the *informative* cases only (those where the stale notes change
  recompute's greedy answer): on the others even the stale baseline agrees, so the target also
  asks for top-1 there, which an operation ignoring the edit cannot meet;
- the median wall time of the fix + question, and recompute's.
"""
from __future__ import annotations

import math

from kvruntime.fidelity.method_stats import op_stats
from kvruntime.fidelity.report import wilson
from kvruntime.fidelity.runner import ANSWER_EDIT_OPS, REFERENCE_OP

EDIT_KINDS = ("lookup", "derived")
# what each row's operation is, for the planner (``params.edit`` names its PlanKind value)
EDIT_PARAMS = {
    "field + top-16": {"edit": "edit_in_place", "top_k": 16},
    "erratum: correction": {"edit": "erratum", "style": "correction"},
    "stale (no fix)": {"edit": "none"},
}


def _interval(k: int, n: int) -> list[float] | None:
    return list(wilson(k, n)) if n else None


def edit_answers_section(rows: dict[str, list[dict]], informative: dict[str, bool], meta: dict) -> dict:
    """``{"meta", "ops": {op: row}}`` with the keys of a ``compose_answers`` row (``n``, ``top1``,
    ``top1_ci``, ``decision_n``, ``decision``, ``decision_ci``, ``answered``, ``accuracy``,
    ``accuracy_recompute``, ``drop_bound``, ``ms_per_request``, ``ms_recompute`` ...) plus
    ``informative_n`` / ``informative_top1`` / ``informative_top1_ci``. ``rows`` needs the
    ``REFERENCE_OP`` rows (``run_edit(reference=True)``); ValueError without them."""
    if not rows.get(REFERENCE_OP):
        raise ValueError("edit answers need recompute's judged rows: run_edit(..., reference=True)")
    ops = {}
    for op in (o for o in ANSWER_EDIT_OPS if rows.get(o)):
        s = op_stats(op, rows, None, EDIT_KINDS)
        if s is None:
            continue
        inf = [r for r in rows[op] if informative.get(r["case"])]
        k_inf = round(sum(r["top1"] for r in inf))
        n, pairs = s["n"], s["pairs"]
        ops[op] = {
            "params": dict(EDIT_PARAMS.get(op, {})), "n": n, "kl_mean": s["kl"],
            "top1": s["top1"] / n, "top1_k": s["top1"], "top1_ci": _interval(s["top1"], n),
            "greedy16": s["exact"] / n, "greedy16_k": s["exact"], "greedy16_ci": _interval(s["exact"], n),
            "decision_n": s["dec_n"], "decision_k": s["dec_k"],
            "decision": s["dec_k"] / s["dec_n"] if s["dec_n"] else None,
            "decision_ci": _interval(s["dec_k"], s["dec_n"]),
            "answered": pairs, "accuracy": (s["a"] + s["c"]) / pairs if pairs else None,
            "accuracy_recompute": (s["a"] + s["b"]) / pairs if pairs else None,
            "lost": s["b"], "gained": s["c"],
            "drop_bound": None if not pairs or math.isnan(s["bound"]) else s["bound"],
            "informative_n": len(inf), "informative_top1_k": k_inf,
            "informative_top1": k_inf / len(inf) if inf else None,
            "informative_top1_ci": _interval(k_inf, len(inf)),
            "tokens_computed_mean": s["computed"], "context_tokens_mean": s["context"],
            "ms_per_request": s["ms"], "ms_recompute": s["ref_ms"],
        }
    cases = {k: len({r["case"] for r in rows[REFERENCE_OP] if r.get("kind") == k}) for k in EDIT_KINDS}
    return {"meta": {**meta, "cases": {**cases, "informative": sum(1 for v in informative.values() if v)}},
            "ops": ops}
