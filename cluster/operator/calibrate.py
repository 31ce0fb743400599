"""``kvnotes calibrate --model DIR``: measure a model's fidelity profile where the planner finds it.

Runs the fidelity sweep (``kvruntime.fidelity``) on the shipped calibration cases with the
reference engine: every compose operation the planner may choose (reposition + seam 1, with
selective recompute of r of each chunk's tokens for r in ``BLEND_RATIOS`` picked by the kv1 probe,
and for r <= the answer target's ratio also by the question, ``qlate`` and ``qlast``) on the compose cases and
on ``decisions`` yes/no decision cases (``cases.load_decision_cases``), and the field edits
(erratum vs edit-in-place), each against a full recompute. The answer-based rows ``balanced`` is
checked against (section ``compose_answers``, with intervals) come from the compose and decision
cases together. The profile is written to
``<profiles dir>/<spec.name>.json`` (``kvruntime.fidelity.profiles``: keyed by the checkpoint's
content hash, so a copy of the directory finds it and changed weights do not), and the operating
point ``balanced`` will use (:func:`cluster.control.planner.choose_compose`) is printed with its
measured speed-up over recompute.

By stage: the cases and operations (:func:`plan_cases`, ``--budget`` here), the resumable run
(``cluster.operator.calibration_run``: run log, progress bar, engine, the measuring loop), the
profile and what it means for the planner (:func:`_finish`). ``--edits-only`` is
``cluster.operator.edit_calibration`` (re-exported here for the CLI).
"""
from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass

from cluster.control.planner import FidelityTarget, choose_compose, choose_edit_kind
from cluster.operator.calibration_run import (EDIT_KEY, RunLog, check_device, default_run_dir,  # noqa: F401
                                              load_engine, machine_line, measure, progress_bar, run_key)
from cluster.operator.edit_calibration import calibrate_edits, print_edit_verdicts  # noqa: F401 - the CLI's

DEFAULT_DECISIONS = 20     # decision cases by default (the answer target trusts no fewer: BALANCED_MIN_CASES)
BUDGET_AT = 0.95           # --budget: the half-width is taken at this agreement rate (the top-1 target)


def wilson_half_width(n: int, p: float = BUDGET_AT) -> float:
    """Half the width of the 95% Wilson interval of k = round(p n) agreements out of n."""
    from kvruntime.fidelity.report import wilson
    lo, hi = wilson(round(p * n), n)
    return (hi - lo) / 2


def cases_for_budget(half_width: float, available: int, p: float = BUDGET_AT) -> int:
    """``--budget``: the fewest cases n whose 95% Wilson interval of an agreement rate at ``p``
    (top-1 agreement at the target, 95%) is at most +-``half_width`` wide. ValueError when the
    shipped cases (``available``) cannot reach it (the message says how narrow they get)."""
    if not 0.0 < half_width < 0.5:
        raise ValueError(f"--budget is a 95% interval half-width in (0, 0.5), e.g. 0.05; got {half_width}")
    for n in range(1, available + 1):
        if wilson_half_width(n, p) <= half_width:
            return n
    raise ValueError(f"--budget {half_width}: the {available} shipped compose + decision cases reach a half-width "
                     f"of {wilson_half_width(available, p):.3f} at best (agreement {p:.0%})")


def split_budget(n: int, compose_available: int, decision_available: int) -> tuple[int, int]:
    """n judged cases -> (compose, decision), decisions in proportion to the shipped sets."""
    dec = min(decision_available, round(n * decision_available / (compose_available + decision_available)))
    comp = min(compose_available, n - dec)
    return comp, min(decision_available, n - comp)


def _answers_row(summary: dict, seam: int, ratio: float, probe: str) -> tuple[str, dict] | None:
    for name, row in ((summary.get("compose_answers") or {}).get("ops") or {}).items():
        p = row.get("params") or {}
        if (p.get("compile", "bos") == "bos" and not p.get("recompute") and int(p.get("seam_tokens", 0)) == seam
                and abs(float(p.get("recompute_ratio", 0.0)) - ratio) < 1e-9
                and (not ratio or p.get("probe", "kv1") == probe)):
            return name, row
    return None


def speedup_line(summary: dict, seam: int, ratio: float, probe: str) -> str:
    """``op: X ms per request vs Y ms recompute (Z x)``, measured on the calibration cases."""
    found = _answers_row(summary, seam, ratio, probe)
    if not found or not found[1].get("ms_per_request") or not found[1].get("ms_recompute"):
        return "no wall time measured for it"
    name, row = found
    ms, ref = row["ms_per_request"], row["ms_recompute"]
    return (f"'{name}' {ms:.0f} ms per request (compose + question, median) vs {ref:.0f} ms full recompute: "
            f"{ref / ms:.2f}x")


@dataclass(frozen=True)
class CasePlan:
    """What one calibration measures: the cases per set and the operations run on them."""
    compose: list
    decision: list
    dec_passages: dict
    edit: list
    ops: dict          # compose operations, on the compose cases
    dec_ops: dict      # those within the answer target's ratio, on the decision cases

    @property
    def case_ids(self) -> dict[str, list[str]]:
        return {"compose": [c.id for c in self.compose], "decision": [c.id for c in self.decision],
                "edit": [c.id for c in self.edit]}


def plan_cases(cases: int | None, decisions: int | None, budget: float | None, target: FidelityTarget) -> CasePlan:
    """``--cases`` / ``--decisions`` / ``--budget`` -> the cases and operations (ValueError on bad counts)."""
    from kvruntime.fidelity.cases import DECISION_CASES, load_compose_cases, load_decision_cases, load_edit_cases
    from kvruntime.fidelity.methods import method_name
    from kvruntime.fidelity.runner import BLEND_RATIOS, REFERENCE_OP, compose_ops
    every_compose = load_compose_cases()
    if budget is not None:
        if cases is not None or decisions is not None:
            raise ValueError("--budget picks the case counts: drop --cases / --decisions")
        n = cases_for_budget(budget, len(every_compose) + DECISION_CASES)
        cases, decisions = split_budget(n, len(every_compose), DECISION_CASES)
        print(f"kvnotes: --budget {budget}: {n} cases ({cases} compose + {decisions} decision) give a 95% Wilson "
              f"half-width of {wilson_half_width(n):.3f} at {BUDGET_AT:.0%} agreement", file=sys.stderr)
    if cases is not None and cases <= 0:
        raise ValueError("--cases must be a positive number of cases")
    decisions = DEFAULT_DECISIONS if decisions is None else decisions
    if not 0 <= decisions <= DECISION_CASES:
        raise ValueError(f"--decisions must be in 0..{DECISION_CASES}, got {decisions}")
    if budget is None:
        decisions = min(decisions, cases) if cases is not None else decisions
    dec_cases, dec_passages = load_decision_cases(decisions) if decisions else ([], {})
    ops = {**compose_ops(BLEND_RATIOS),
           **compose_ops([r for r in BLEND_RATIOS if r <= target.max_ratio], ("qlate", "qlast"))}
    dec_ops = {k: v for k, v in ops.items() if v.get("recompute_ratio", 0.0) <= target.max_ratio
               and method_name(k) not in (None, REFERENCE_OP)}
    return CasePlan(every_compose[:cases], dec_cases, dec_passages, load_edit_cases()[:cases], ops, dec_ops)


def calibrate(model: str, *, cases: int | None = None, decisions: int | None = None, out: str | None = None,
              dtype: str = "float32", device: str = "cpu", threads: int | None = None,
              target: FidelityTarget | None = None, command: str = "", stream=sys.stdout,
              run_dir: str | None = None, budget: float | None = None, progress: bool = True) -> dict:
    """Measure and save ``model``'s profile; returns ``{"path", "summary", "balanced", "edit",
    "run_dir"}``. ``target``: ``balanced``'s (default :meth:`FidelityTarget.answers`);
    ``decisions``: yes/no cases (default 20, capped by ``cases``); ``budget``: a 95% interval
    half-width that picks the compose and decision case counts (:func:`cases_for_budget`; not
    with ``cases``/``decisions``); ``run_dir``: where finished cases are logged (resume)."""
    from kvruntime.fidelity.cases import load_passages
    from kvruntime.models import get_model_spec

    check_device(device)
    target = target or FidelityTarget.answers()
    plan = plan_cases(cases, decisions, budget, target)
    spec = get_model_spec(model)                  # refused architectures: one line, nothing loaded
    case_ids = plan.case_ids
    log = RunLog.open(spec, dtype, run_key(spec.content_hash, dtype, case_ids, {**plan.ops, **EDIT_KEY}), run_dir)
    total = sum(len(v) for v in case_ids.values())
    print(f"kvnotes: calibrating {spec.name} ({dtype}, {device}): {len(plan.compose)} compose cases, "
          f"{len(plan.decision)} decision cases, {len(plan.edit)} edit cases; run log {log.path}"
          + (f" (resuming: {len(log.done)} of {total} cases done)" if log.done else ""), file=sys.stderr)
    bar = progress_bar(total, len(log.done), progress)
    try:
        if len(log.done) < total:
            measure(load_engine(spec, dtype, device, threads), log, bar, plan.compose, plan.decision, plan.edit,
                    load_passages(), plan.dec_passages, plan.ops, plan.dec_ops)
    finally:
        bar.close()
        log.close()
    return _finish(spec, model, dtype, device, command, log, case_ids, plan.ops, target, out, stream)


def _profile(meta: dict, log: RunLog, case_ids: dict, ops: dict) -> dict:
    """The profile's sections from the logged rows (as one uninterrupted run gives them)."""
    from kvruntime.fidelity.edit_answers import edit_answers_section
    from kvruntime.fidelity.methods import answers_section, as_method_rows
    from kvruntime.fidelity.report import build_summary, build_sweep
    from kvruntime.fidelity.runner import COMPOSE_OPS, REFERENCE_OP
    rows, edit_rows = log.rows("compose", case_ids["compose"]), log.rows("edit", case_ids["edit"])
    informative = log.informative(case_ids["edit"])
    fixed = {op: r for op, r in rows.items() if op in COMPOSE_OPS or op == REFERENCE_OP}
    summary = build_summary(meta, fixed, {op: r for op, r in edit_rows.items() if op != REFERENCE_OP},
                            informative, {}, {})
    summary["edit_answers"] = edit_answers_section(edit_rows, informative, meta)
    summary["compose_sweep"] = build_sweep(meta, {op: r for op, r in rows.items() if op not in fixed
                                                  or op in (REFERENCE_OP, "reposition + seam 1")}, ops)
    summary["compose_answers"] = answers_section(as_method_rows(rows, log.rows("decision", case_ids["decision"])),
                                                 meta)
    return summary


def _finish(spec, model, dtype, device, command, log, case_ids, ops, target, out, stream) -> dict:
    from kvruntime.fidelity.profiles import write_profile
    meta = {"model": spec.name, "checkpoint": spec.checkpoint, "content_hash": spec.content_hash, "dtype": dtype,
            "device": device, "command": command or f"kvnotes calibrate --model {model}",
            "date": datetime.date.today().isoformat(), "machine": machine_line(),
            "seconds": sum(r.get("wall_s", 0.0) for r in log.done.values()),
            "cpu_seconds": sum(r.get("cpu_s", 0.0) for r in log.done.values()),
            "cases": {"compose": len(case_ids["compose"]), "decision": len(case_ids["decision"]),
                      "edit": len(case_ids["edit"]), "informative": sum(log.informative(case_ids["edit"]).values())}}
    summary = _profile(meta, log, case_ids, ops)
    path = write_profile(spec, summary, out)
    balanced = choose_compose(summary, target, model=spec.name)
    edit = choose_edit_kind(summary, min_top1=target.minimum)
    print(f"kvnotes: profile of {spec.name} written to {path} ({meta['seconds']:.0f} s measuring, "
          f"{meta['cpu_seconds']:.0f} s CPU, "
          f"{sum(meta['cases'][k] for k in ('compose', 'decision', 'edit'))} cases; run log {log.path})", file=stream)
    if balanced.allowed:
        print(f"kvnotes: balanced will compose chunks after the first with {balanced.op}: "
              f"{speedup_line(summary, balanced.seam_tokens, balanced.recompute_ratio, balanced.probe)}; "
              f"{balanced.reason}", file=stream)
    else:
        print(f"kvnotes: balanced will recompute chunks after the first (exact reuse only): {balanced.reason}",
              file=stream)
    print(f"kvnotes: fast composes with reposition + seam 1: {speedup_line(summary, 1, 0.0, 'kv1')}", file=stream)
    print(f"kvnotes: field edits under fast: {edit.kind.value} ({edit.reason})", file=stream)
    print_edit_verdicts(summary, target, spec.name, stream)
    return {"path": path, "summary": summary, "balanced": balanced, "edit": edit, "run_dir": log.dir}
