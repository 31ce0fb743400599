"""``kvnotes calibrate --model DIR``: measure a model's fidelity profile where the planner finds it.

Runs the fidelity sweep (``kvruntime.fidelity``) on the shipped calibration cases with the
reference engine: every compose operation the planner may choose (reposition + seam 1, with
selective recompute of r of each chunk's tokens for r in ``BLEND_RATIOS``) and the field edits
(erratum vs edit-in-place), each against a full recompute. The profile is written to
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


def calibrate(model: str, *, cases: int | None = None, out: str | None = None, dtype: str = "float32",
              device: str = "cpu", threads: int | None = None, min_top1: float = 0.97,
              command: str = "", stream=sys.stdout) -> dict:
    """Measure and save ``model``'s profile; returns ``{"path", "summary", "balanced", "edit"}``."""
    import torch

    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_compose_cases, load_edit_cases, load_passages
    from kvruntime.fidelity.profiles import write_profile
    from kvruntime.fidelity.report import build_summary, build_sweep
    from kvruntime.fidelity.runner import BLEND_RATIOS, COMPOSE_OPS, REFERENCE_OP, compose_ops, run_compose, run_edit
    from kvruntime.models import get_model_spec

    if cases is not None and cases <= 0:
        raise ValueError("--cases must be a positive number of cases")
    spec = get_model_spec(model)                  # refused architectures: one line, nothing loaded
    started = time.monotonic()
    engine = ReferenceEngine(spec, dtype=dtype, device=device, threads=threads)
    if not engine.rope.enabled:
        raise RuntimeError(f"model {spec.name}: RoPE self-test failed (error {engine.rope.self_test_error}); "
                           "repositioning is disabled for it, so there is nothing to calibrate")
    compose_cases, edit_cases = load_compose_cases()[:cases], load_edit_cases()[:cases]
    print(f"kvnotes: calibrating {spec.name} ({dtype}, {device}): {len(compose_cases)} compose cases, "
          f"{len(edit_cases)} edit cases", file=sys.stderr)
    ops = compose_ops(BLEND_RATIOS)
    rows = run_compose(engine, compose_cases, load_passages(), ops=ops)
    edit_rows, informative = run_edit(engine, edit_cases)
    meta = {"model": spec.name, "checkpoint": spec.checkpoint, "content_hash": spec.content_hash, "dtype": dtype,
            "device": device, "command": command or f"kvnotes calibrate --model {model}",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "seconds": time.monotonic() - started,
            "cases": {"compose": len(compose_cases), "edit": len(edit_cases),
                      "informative": sum(informative.values())}}
    fixed = {op: r for op, r in rows.items() if op in COMPOSE_OPS or op == REFERENCE_OP}
    summary = build_summary(meta, fixed, edit_rows, informative, {}, {})
    summary["compose_sweep"] = build_sweep(meta, {op: r for op, r in rows.items() if op not in fixed
                                                  or op in (REFERENCE_OP, "reposition + seam 1")}, ops)
    path = write_profile(spec, summary, out)
    target = FidelityTarget("top1", min_top1)
    balanced = choose_compose(summary, target, model=spec.name)
    edit = choose_edit_kind(summary)
    print(f"kvnotes: profile of {spec.name} written to {path} ({meta['seconds']:.0f} s)", file=stream)
    if balanced.allowed:
        print(f"kvnotes: balanced will compose with {balanced.op}: {balanced.reason}", file=stream)
    else:
        few = f" (rows need at least {target.min_cases} cases)" if len(compose_cases) < target.min_cases else ""
        print(f"kvnotes: balanced will recompute chunks (exact reuse only): {balanced.reason}{few}", file=stream)
    print(f"kvnotes: field edits under fast: {edit.kind.value} ({edit.reason})", file=stream)
    return {"path": path, "summary": summary, "balanced": balanced, "edit": edit}
