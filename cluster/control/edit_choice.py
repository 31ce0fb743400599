"""Erratum or edit-in-place for a session's field edits, chosen from a model's fidelity summary
(its informative edit cases): the planner's ``PlannerConfig.edit`` (re-exported by ``planner``)."""
from __future__ import annotations

from dataclasses import dataclass

from kvruntime.errata import DEFAULT_ERRATUM_STYLE
from kvruntime.messages.plan import PlanKind


@dataclass(frozen=True)
class EditChoice:
    kind: PlanKind                              # ERRATUM or EDIT_IN_PLACE
    top_k: int = 0
    erratum_style: str = DEFAULT_ERRATUM_STYLE
    reason: str = ""


EDIT_OPS = {PlanKind.ERRATUM: "erratum: correction", PlanKind.EDIT_IN_PLACE: "field + top-16"}


def choose_edit_kind(summary: dict | None, *, min_top1: float = 0.95, top_k: int = 16) -> EditChoice:
    """Erratum vs edit-in-place from a model's fidelity summary (``kvnotes eval fidelity``), on the
    informative edit cases (those where the edit changes the model's answer): of the operations
    whose top-1 agreement with a full recompute meets ``min_top1`` (the model's fidelity target),
    the cheapest by measured cost (``seconds_mean``: the fix and the question, timed in the same
    run; the tokens each one computes when the table has no timings); when none meets the target,
    the most faithful one (greedy agreement, then top-1, then lower KL), and the reason says so.
    Without a table the answer is erratum, and the reason says so."""
    if not summary or not summary.get("edit_informative"):
        return EditChoice(PlanKind.ERRATUM, reason="no fidelity table for this model: erratum by default")
    table = summary["edit_informative"]
    cand = {k: table.get(op) for k, op in EDIT_OPS.items()}
    cand = {k: v for k, v in cand.items() if v and v.get("n")}
    if not cand:
        return EditChoice(PlanKind.ERRATUM, reason="fidelity table has no informative edit cases: erratum by default")

    def faithful(s):
        return (s.get("greedy_exact") or 0.0, s.get("top1") or 0.0, -(s.get("kl_mean") or 0.0))

    def measured(s):
        v = s.get("seconds_mean")
        return v is not None and v == v       # NaN: not timed

    timed = all(measured(s) for s in cand.values())

    def cost(s):
        return s["seconds_mean"] if timed else s.get("recomputed_tokens_mean") or 0.0

    def stats(k):
        s = cand[k]
        c = f"{s['seconds_mean'] * 1e3:.0f} ms" if timed else f"{s.get('recomputed_tokens_mean') or 0:.0f} tokens computed"
        return f"{EDIT_OPS[k]}: top-1 {s.get('top1') or 0:.0%}, greedy {s.get('greedy_exact') or 0:.0%}, {c}"
    meets = [k for k, s in cand.items() if (s.get("top1") or 0.0) >= min_top1]
    n = max(s["n"] for s in cand.values())
    if meets:
        best = min(meets, key=lambda k: cost(cand[k]))
        why = (f"fidelity table ({n} informative cases): the cheapest {'by measured time' if timed else 'by tokens computed (no timings in the table)'} "
               f"of those meeting top-1 >= {min_top1:.0%}; " + "; ".join(stats(k) for k in cand))
    else:
        best = max(cand, key=lambda k: faithful(cand[k]))
        why = (f"fidelity table ({n} informative cases): none meets top-1 >= {min_top1:.0%}, the most faithful; "
               + "; ".join(stats(k) for k in cand))
    return EditChoice(best, top_k=top_k if best is PlanKind.EDIT_IN_PLACE else 0, reason=why)
