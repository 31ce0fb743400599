"""``kvnotes calibrate --model DIR``: measure a model's fidelity profile where the planner finds it.

Runs the fidelity sweep (``kvruntime.fidelity``) on the shipped calibration cases with the
reference engine: every compose operation the planner may choose (reposition + seam 1, with
selective recompute of r of each chunk's tokens for r in ``BLEND_RATIOS`` picked by the kv1 probe,
and for r <= the answer target's ratio also by the question, ``qlate``) on the compose cases and
on ``decisions`` yes/no decision cases (``cases.load_decision_cases``), and the field edits
(erratum vs edit-in-place), each against a full recompute. The answer-based rows ``balanced`` is
checked against (section ``compose_answers``, with intervals) come from the compose and decision
cases together. The profile is written to
``<profiles dir>/<spec.name>.json`` (``kvruntime.fidelity.profiles``: keyed by the checkpoint's
content hash, so a copy of the directory finds it and changed weights do not), and the operating
point ``balanced`` will use (:func:`cluster.control.planner.choose_compose`) is printed.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time

from cluster.control.planner import FidelityTarget, choose_compose, choose_edit_kind


DEFAULT_DECISIONS = 20     # decision cases by default (the answer target trusts no fewer: BALANCED_MIN_CASES)


def calibrate(model: str, *, cases: int | None = None, decisions: int | None = None, out: str | None = None,
              dtype: str = "float32", device: str = "cpu", threads: int | None = None,
              target: FidelityTarget | None = None, command: str = "", stream=sys.stdout) -> dict:
    """Measure and save ``model``'s profile; returns ``{"path", "summary", "balanced", "edit"}``.
    ``target``: ``balanced``'s (default :meth:`FidelityTarget.answers`); ``decisions``: yes/no
    cases (default 20, capped by ``cases``)."""
    import torch

    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import DECISION_CASES, load_compose_cases, load_edit_cases, load_passages
    from kvruntime.fidelity.methods import answers_from_runs, run_decisions
    from kvruntime.fidelity.profiles import write_profile
    from kvruntime.fidelity.report import build_summary, build_sweep
    from kvruntime.fidelity.runner import BLEND_RATIOS, COMPOSE_OPS, REFERENCE_OP, compose_ops, run_compose, run_edit
    from kvruntime.models import get_model_spec

    if cases is not None and cases <= 0:
        raise ValueError("--cases must be a positive number of cases")
    decisions = DEFAULT_DECISIONS if decisions is None else decisions
    if not 0 <= decisions <= DECISION_CASES:
        raise ValueError(f"--decisions must be in 0..{DECISION_CASES}, got {decisions}")
    decisions = min(decisions, cases) if cases is not None else decisions
    target = target or FidelityTarget.answers()
    spec = get_model_spec(model)                  # refused architectures: one line, nothing loaded
    started = time.monotonic()
    engine = ReferenceEngine(spec, dtype=dtype, device=device, threads=threads)
    if not engine.rope.enabled:
        raise RuntimeError(f"model {spec.name}: RoPE self-test failed (error {engine.rope.self_test_error}); "
                           "repositioning is disabled for it, so there is nothing to calibrate")
    compose_cases, edit_cases = load_compose_cases()[:cases], load_edit_cases()[:cases]
    print(f"kvnotes: calibrating {spec.name} ({dtype}, {device}): {len(compose_cases)} compose cases, "
          f"{decisions} decision cases, {len(edit_cases)} edit cases", file=sys.stderr)
    ops = {**compose_ops(BLEND_RATIOS),
           **compose_ops([r for r in BLEND_RATIOS if r <= target.max_ratio], ("qlate",))}
    rows = run_compose(engine, compose_cases, load_passages(), ops=ops)
    decision_rows = run_decisions(engine, decisions, {k: v for k, v in ops.items()
                                                      if v.get("recompute_ratio", 0.0) <= target.max_ratio})
    edit_rows, informative = run_edit(engine, edit_cases)
    meta = {"model": spec.name, "checkpoint": spec.checkpoint, "content_hash": spec.content_hash, "dtype": dtype,
            "device": device, "command": command or f"kvnotes calibrate --model {model}",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "seconds": time.monotonic() - started,
            "cases": {"compose": len(compose_cases), "decision": decisions, "edit": len(edit_cases),
                      "informative": sum(informative.values())}}
    fixed = {op: r for op, r in rows.items() if op in COMPOSE_OPS or op == REFERENCE_OP}
    summary = build_summary(meta, fixed, edit_rows, informative, {}, {})
    summary["compose_sweep"] = build_sweep(meta, {op: r for op, r in rows.items() if op not in fixed
                                                  or op in (REFERENCE_OP, "reposition + seam 1")}, ops)
    summary["compose_answers"] = answers_from_runs(meta, rows, decision_rows)
    path = write_profile(spec, summary, out)
    balanced = choose_compose(summary, target, model=spec.name)
    edit = choose_edit_kind(summary)
    print(f"kvnotes: profile of {spec.name} written to {path} ({meta['seconds']:.0f} s)", file=stream)
    if balanced.allowed:
        print(f"kvnotes: balanced will compose with {balanced.op}: {balanced.reason}", file=stream)
    else:
        print(f"kvnotes: balanced will recompute chunks (exact reuse only): {balanced.reason}", file=stream)
    print(f"kvnotes: field edits under fast: {edit.kind.value} ({edit.reason})", file=stream)
    return {"path": path, "summary": summary, "balanced": balanced, "edit": edit}
