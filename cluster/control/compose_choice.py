"""Which compose operation a policy may plan for a model, from its measured fidelity profile: a pure
function of the profile and the policy's target (:func:`choose_compose`), read by the planner
(:mod:`cluster.control.planner`) through ``PlannerConfig`` and re-made by the shadow checks
(:mod:`cluster.control.shadow`) when an operation is demoted or readmitted."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvruntime.messages.plan import PlanKind

@dataclass(frozen=True)
class FidelityTarget:
    """What a policy promises about composed chunks, checked against the measured profile.

    ``basis="next_token"`` (``fast_min_top1``): every row of the op in the profile's ``compose`` and
    ``compose_sweep`` sections has ``metric`` >= ``minimum`` on >= ``min_cases`` cases.
    ``basis="answers"`` (``balanced``, :meth:`answers`): the op's row in ``compose_answers`` has
    top-1 agreement >= ``minimum``, a one-sided 95% upper bound of its answer-accuracy drop vs
    recompute <= ``max_drop``, yes/no decision agreement with recompute >= ``min_decision`` and a
    recompute ratio r <= ``max_ratio``; counted on >= ``min_cases`` cases (all kinds, top-1),
    >= ``min_answered`` judged answers (paired with recompute's) and >= ``min_decisions`` decision
    cases. Fewer cases: the op is not trusted, whatever its point estimates."""
    metric: str = "top1"           # a profile row's key: top1 | greedy_exact | greedy_prefix
    minimum: float = 0.97          # the row's value must be >= this
    min_cases: int = 10            # rows measured on fewer cases are not trusted
    basis: str = "next_token"      # next_token | answers
    max_drop: float = 1.0          # answers: accuracy-drop bound (fraction: 0.02 = 2 points)
    min_decision: float = 0.0      # answers: decision agreement
    max_ratio: float = 1.0         # answers: recompute ratio r
    min_answered: int = 0          # answers: judged answers needed
    min_decisions: int = 0         # answers: decision cases needed

    def __post_init__(self):
        if self.metric not in ("top1", "greedy_exact", "greedy_prefix"):
            raise ValueError(f"fidelity target metric must be top1, greedy_exact or greedy_prefix, got {self.metric!r}")
        if not 0.0 <= self.minimum <= 1.0 or self.min_cases < 1:
            raise ValueError("fidelity target minimum must be in [0, 1] and min_cases >= 1")
        if self.basis not in ("next_token", "answers"):
            raise ValueError(f"fidelity target basis must be next_token or answers, got {self.basis!r}")
        if not all(0.0 <= x <= 1.0 for x in (self.max_drop, self.min_decision, self.max_ratio)) \
                or self.min_answered < 0 or self.min_decisions < 0:
            raise ValueError("fidelity target max_drop, min_decision, max_ratio must be in [0, 1] and case counts >= 0")

    @classmethod
    def answers(cls, *, min_top1: float | None = None, max_drop: float | None = None,
                min_decision: float | None = None, max_ratio: float | None = None,
                min_cases: int | None = None) -> "FidelityTarget":
        """``balanced``'s answer target; unset values are the config's defaults
        (``kvruntime.config.BALANCED_ANSWER_TARGET`` / ``BALANCED_MIN_CASES``): 30 cases,
        30 judged answers, 20 decision cases at least."""
        from kvruntime.config import BALANCED_ANSWER_TARGET as T, BALANCED_MIN_CASES as N
        n = N["cases"] if min_cases is None else min_cases
        return cls("top1", T["top1"] if min_top1 is None else min_top1, n, "answers",
                   T["drop_bound"] if max_drop is None else max_drop,
                   T["decision"] if min_decision is None else min_decision,
                   T["max_ratio"] if max_ratio is None else max_ratio,
                   max(1, round(n * N["answered"] / N["cases"])), max(1, round(n * N["decisions"] / N["cases"])))

    @classmethod
    def from_config(cls, cfg) -> "FidelityTarget":
        """``balanced``'s target from a :class:`~kvruntime.config.ClusterConfig`."""
        p = cfg.policy
        return cls.answers(min_top1=p.balanced_min_top1, max_drop=p.balanced_max_accuracy_drop,
                           min_decision=p.balanced_min_decision, max_ratio=p.balanced_max_recompute_ratio,
                           min_cases=p.balanced_min_cases)

    def describe(self) -> dict:
        """What ``Router.fidelity`` shows for this target."""
        if self.basis == "next_token":
            return {self.metric: self.minimum, "min_cases": self.min_cases}
        return {"top1": self.minimum, "accuracy_drop_bound": self.max_drop, "decision": self.min_decision,
                "max_recompute_ratio": self.max_ratio, "min_cases": self.min_cases,
                "min_answered": self.min_answered, "min_decisions": self.min_decisions}


@dataclass(frozen=True)
class ComposeChoice:
    """How a policy composes precompiled chunks for this model (from :func:`choose_compose`)."""
    allowed: bool                  # False: chunks are recomputed (no profile, or no row meets the target)
    seam_tokens: int = 1
    recompute_ratio: float = 0.0
    op: str = ""                   # operation key (shadow checks and demotion count per key)
    reason: str = ""               # the profile row(s) that justified it, for ``explain``
    probe: str = "kv1"             # how the r tokens are picked (SegmentPlan.probe)


def compose_op_key(seam_tokens: int, recompute_ratio: float, probe: str = "kv1") -> str:
    """The key shadow checks and demotion count under; the default probe keeps the old key."""
    tail = f",probe={probe}" if recompute_ratio and probe != "kv1" else ""
    return f"reposition(seam={seam_tokens},r={recompute_ratio:g}{tail})"


EXECUTED_PROBE = "kv1"   # ops.compose's default probe; executors also run question probes (q...)
# kvruntime.ops.probes' syntax (not imported here: kvruntime.ops loads torch; the planner is pure)
_QUESTION_PROBE = re.compile(r"^q(last|late|\d+)(?:-g(\d+))?$")
# How the cluster compiles a chunk that is NOT the first after the chat frame (that one is exact
# reuse of its frame variant): after BOS alone (its registered KVRef). compose_answers rows compiled
# otherwise ("frame", "nl<k>") describe KV the executors never build, so the answer target skips them.
PLANNED_COMPILE = "bos"


def executable_probe(probe: str) -> bool:
    """Probes prefill executors run: kv1 (``ops.blend``) and question probes (``ops.qselect``)."""
    return probe == EXECUTED_PROBE or bool(_QUESTION_PROBE.match(probe or ""))


def _pct(x: float) -> str:
    """97% stays "97%"; 96.67% is "96.7%", never rounded up to a target it misses."""
    return f"{x:.0%}" if abs(x * 100 - round(x * 100)) < 1e-9 else f"{x:.1%}"


def _ci(ci) -> str:
    return f" [{ci[0] * 100:.0f}-{ci[1] * 100:.0f}%]" if ci and None not in ci else ""


def choose_compose(summary: dict | None, target: FidelityTarget, *, demoted: frozenset[str] = frozenset(),
                   model: str = "") -> ComposeChoice:
    """The cheapest compose operation (lowest r, then fewest seam tokens) the model's profile says
    meets ``target``; operations in ``demoted`` (online shadow checks fell below the target) are
    skipped. No profile, or nothing meets it: not allowed (chunks recomputed), and the reason says
    why. ``target.basis`` picks the rows: ``answers`` -> section ``compose_answers``
    (:func:`_choose_by_answers`); ``next_token`` -> every row in ``compose`` and ``compose_sweep``."""
    if not summary:
        return ComposeChoice(False, reason="no fidelity profile for this model: only exact reuse until one is measured")
    if target.basis == "answers":
        return _choose_by_answers(summary, target, demoted, model)
    groups: dict[tuple[int, float, str], list[tuple[str, str, dict]]] = {}
    sections = [("compose", summary.get("compose") or {}),
                ("compose_sweep", (summary.get("compose_sweep") or {}).get("ops") or {})]
    for sec, rows in sections:
        for name, row in rows.items():
            p = row.get("params") or {}
            if p.get("recompute") or not p.get("rotate", False):
                continue                                   # the reference row; naive splice never plans
            if p.get("compile", PLANNED_COMPILE) != PLANNED_COMPILE:
                continue
            probe = p.get("probe", EXECUTED_PROBE) if p.get("recompute_ratio") else EXECUTED_PROBE
            if not executable_probe(probe):
                continue                                   # measured with a probe executors do not run
            key = (int(p.get("seam_tokens", 0)), float(p.get("recompute_ratio", 0.0)), probe)
            groups.setdefault(key, []).append((sec, name, row))
    want = f"{target.metric} >= {_pct(target.minimum)}"
    skipped = []
    for (seam, ratio, probe) in sorted(groups, key=lambda k: (k[1], k[0], k[2] != EXECUTED_PROBE, k[2])):
        rows, key = groups[(seam, ratio, probe)], compose_op_key(seam, ratio, probe)
        ok = all((r.get(target.metric) or 0.0) >= target.minimum and (r.get("n") or 0) >= target.min_cases
                 for _, _, r in rows)
        if ok and key in demoted:
            skipped.append(key)
            continue
        if ok:
            cited = "; ".join(f"{model or 'profile'} {sec} row '{name}': {target.metric} {_pct(r[target.metric])} "
                              f"on {r['n']} cases" for sec, name, r in rows)
            return ComposeChoice(True, seam, ratio, key, f"{want} met by {cited}"
                                 + (f" (demoted online: {', '.join(skipped)})" if skipped else ""), probe)
    return ComposeChoice(False, reason=f"no compose operation in the {model or 'model'}'s fidelity profile meets "
                                       f"{want}" + (f" (demoted online: {', '.join(skipped)})" if skipped else "")
                                       + ": chunks recomputed")


def answer_criteria(row: dict, target: FidelityTarget, *, ratio_part: bool = True) -> list[tuple[bool, float, str]]:
    """Each part of the answer target on one ``compose_answers`` row: (met, shortfall, text citing
    the row's numbers and interval). The shortfall (0 when met) ranks the nearest candidate.
    ``ratio_part=False``: no recompute-ratio part (an edit's row: it has no r)."""
    n, dn, an = row.get("n") or 0, row.get("decision_n") or 0, row.get("answered") or 0
    top1, dec, bound = row.get("top1"), row.get("decision"), row.get("drop_bound")
    ratio = float((row.get("params") or {}).get("recompute_ratio", 0.0))
    out = []
    t_ok = top1 is not None and top1 >= target.minimum
    out.append((t_ok, 0.0 if t_ok else target.minimum - (top1 or 0.0),
                f"top-1 agreement {_pct(top1 or 0.0)}{_ci(row.get('top1_ci'))} on {n} cases"
                + ("" if t_ok else f" (needs >= {_pct(target.minimum)})")))
    d_ok = dec is not None and dec >= target.min_decision
    out.append((d_ok, 0.0 if d_ok else target.min_decision - (dec or 0.0),
                (f"decision agreement {_pct(dec)}{_ci(row.get('decision_ci'))} on {dn} cases" if dec is not None
                 else "no decision cases measured") + ("" if d_ok else f" (needs >= {_pct(target.min_decision)})")))
    b_ok = bound is not None and bound <= target.max_drop
    right = (f"; {round(row['accuracy'] * an)}/{an} right vs recompute's {round(row['accuracy_recompute'] * an)}/{an}"
             if an and row.get("accuracy") is not None and row.get("accuracy_recompute") is not None else "")
    need = "" if b_ok else f", needs <= {target.max_drop * 100:g}"
    out.append((b_ok, 0.0 if b_ok else (bound if bound is not None else 1.0) - target.max_drop,
                f"accuracy drop <= {bound * 100:.1f} points (95% bound{need}{right})" if bound is not None
                else f"no judged answers{need}"))
    r_ok = ratio <= target.max_ratio + 1e-12
    share = row.get("chunk_share")
    if ratio_part:
        out.append((r_ok, 0.0 if r_ok else ratio - target.max_ratio,
                    f"r {_pct(ratio)}" + ("" if r_ok else f" (needs <= {_pct(target.max_ratio)})")
                    + (f" ({share:.1%} of chunk tokens recomputed with the seams)" if share is not None else "")))
    for have, need, what in ((n, target.min_cases, "cases"), (an, target.min_answered, "judged answers"),
                             (dn, target.min_decisions, "decision cases")):
        if have < need:
            out.append((False, 0.0, f"only {have} {what} measured (needs >= {need})"))
    return out


def _choose_by_answers(summary: dict, target: FidelityTarget, demoted: frozenset[str], model: str) -> ComposeChoice:
    """``balanced``: the cheapest op (lowest r, fewest seams, then lower measured ms per request)
    whose ``compose_answers`` row meets every part of the answer target (:func:`answer_criteria`).
    The reason cites the numbers that met it, or the nearest candidate (fewest criteria missed,
    then smallest shortfall) and what it missed, with intervals."""
    who = model or "model"
    ops = (summary.get("compose_answers") or {}).get("ops") or {}
    cands, other = [], set()
    for name, row in ops.items():
        p = row.get("params") or {}
        if p.get("compile", PLANNED_COMPILE) != PLANNED_COMPILE:
            other.add(p["compile"])
        if p.get("recompute") or not p.get("rotate", True) or p.get("compile", PLANNED_COMPILE) != PLANNED_COMPILE:
            continue
        seam, ratio = int(p.get("seam_tokens", 1)), float(p.get("recompute_ratio", 0.0))
        probe = p.get("probe", EXECUTED_PROBE) if ratio else EXECUTED_PROBE
        if not executable_probe(probe):
            continue
        cands.append((ratio, seam, row.get("ms_per_request") or math.inf, name, probe, row))
    if not cands:
        return ComposeChoice(False, reason=f"balanced: the {who}'s fidelity profile has no answer-based rows for an "
                                           f"operation the cluster runs (section compose_answers, compile "
                                           f"{PLANNED_COMPILE!r}): chunks recomputed")
    skipped, misses = [], []
    for ratio, seam, _, name, probe, row in sorted(cands, key=lambda c: c[:4]):
        crit = answer_criteria(row, target)
        key = compose_op_key(seam, ratio, probe)
        if all(ok for ok, _, _ in crit):
            if key in demoted:
                skipped.append(key)
                continue
            return ComposeChoice(True, seam, ratio, key,
                                 f"balanced: answer target met by {who} compose_answers row '{name}': "
                                 + ", ".join(t for _, _, t in crit)
                                 + (f" (demoted online: {', '.join(skipped)})" if skipped else ""), probe)
        misses.append((sum(1 for ok, _, _ in crit if not ok), sum(g for _, g, _ in crit), name, crit))
    tail = f" (demoted online: {', '.join(skipped)})" if skipped else ""
    note = (f". Rows compiled after {'/'.join(sorted(other))} are not planned (the cluster compiles later "
            f"chunks after {PLANNED_COMPILE})" if other else "")
    if not misses:
        return ComposeChoice(False, reason=f"balanced: every operation meeting the answer target is demoted{tail}: "
                                           "chunks recomputed")
    _, _, name, crit = min(misses, key=lambda m: (m[0], m[1], m[2]))
    return ComposeChoice(False, reason=f"balanced: no operation in the {who}'s profile meets the answer target; "
                                       f"nearest {name}: " + ", ".join(t for ok, _, t in crit if not ok)
                                       + "; met: " + (", ".join(t for ok, _, t in crit if ok) or "none")
                                       + f"{tail}: chunks recomputed{note}")


# ---- edits under balanced: the same answer target on the profile's ``edit_answers`` rows ----------
EDIT_MIN_INFORMATIVE = 10   # informative edit cases (the edit changes recompute's answer) needed
EDIT_ANSWER_ROWS = {"edit_in_place": "field + top-16", "erratum": "erratum: correction"}


@dataclass(frozen=True)
class EditVerdict:
    """May ``balanced`` plan this edit operation for the model (:func:`choose_edits_by_answers`)?"""
    kind: PlanKind                 # EDIT_IN_PLACE or ERRATUM
    allowed: bool
    reason: str                    # the profile row and its numbers, met or missed, for ``explain``
    row: str = ""                  # the edit_answers row cited ("" when the profile has none)


def edit_criteria(row: dict, target: FidelityTarget) -> list[tuple[bool, float, str]]:
    """The answer target (:func:`answer_criteria`, no ratio part) plus top-1 on the informative
    cases, where the stale notes change recompute's answer: on the others an operation that ignores
    the edit agrees too, so without this part ignoring it would pass."""
    out = answer_criteria(row, target, ratio_part=False)
    k, n, top1 = row.get("informative_top1_k") or 0, row.get("informative_n") or 0, row.get("informative_top1")
    ok = top1 is not None and top1 >= target.minimum and n >= EDIT_MIN_INFORMATIVE
    out.append((ok, 0.0 if ok else target.minimum - (top1 or 0.0),
                f"top-1 {_pct(top1 or 0.0)}{_ci(row.get('informative_top1_ci'))} on {n} informative cases ({k}/{n})"
                + ("" if top1 is not None and top1 >= target.minimum else f" (needs >= {_pct(target.minimum)})")
                + ("" if n >= EDIT_MIN_INFORMATIVE else f" (needs >= {EDIT_MIN_INFORMATIVE} informative cases)")))
    return out


def choose_edits_by_answers(summary: dict | None, target: FidelityTarget, *, model: str = "") -> tuple[EditVerdict, ...]:
    """For edit-in-place and the erratum, whether the model's profile (section ``edit_answers``,
    ``kvnotes calibrate``) shows it meets ``balanced``'s answer target (:func:`edit_criteria`).
    No section or no row: not allowed, and the reason says what to run."""
    who = model or "model"
    rows = ((summary or {}).get("edit_answers") or {}).get("ops") or {}
    out = []
    for value, name in EDIT_ANSWER_ROWS.items():
        kind = PlanKind(value)
        row = rows.get(name)
        if row is None:
            out.append(EditVerdict(kind, False, f"balanced: the {who}'s fidelity profile has no answer-level row for "
                                                f"{value} (section edit_answers: `kvnotes calibrate --edits-only`)"))
            continue
        crit = edit_criteria(row, target)
        ok = all(m for m, _, _ in crit)
        text = (", ".join(t for _, _, t in crit) if ok else
                ", ".join(t for m, _, t in crit if not m) + "; met: " + (", ".join(t for m, _, t in crit if m) or "none"))
        out.append(EditVerdict(kind, ok, f"balanced: {who} edit_answers row '{name}' "
                                         f"{'meets' if ok else 'misses'} the answer target: {text}", name))
    return tuple(out)
