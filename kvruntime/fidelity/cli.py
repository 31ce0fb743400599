"""``kvnotes eval fidelity`` and ``kvnotes eval report``."""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

from kvruntime.fidelity import report
from kvruntime.fidelity.cases import DECISION_CASES, load_compose_cases, load_edit_cases, load_passages
from kvruntime.fidelity.methods import answers_from_runs, run_decisions
from kvruntime.fidelity.runner import COMPOSE_OPS, compose_ops, run_compose, run_edit

DEFAULT_DECISIONS = 20      # yes/no decision cases per run (the answer target needs >= 20: BALANCED_MIN_CASES)

BEGIN, END = "<!-- BEGIN GENERATED: kvnotes eval report -->", "<!-- END GENERATED -->"


def eval_fidelity(args, argv: list[str]) -> int:
    from kvruntime.engine import ReferenceEngine

    if args.limit is not None and args.limit <= 0:
        raise ValueError("--limit must be a positive number of cases")
    ratios = tuple(getattr(args, "ratios", None) or ())
    for r in ratios:
        if not 0 < r <= 1:
            raise ValueError(f"--ratios must be in (0, 1], got {r}")
    probes = tuple(getattr(args, "probes", None) or ("kv1",))
    seams = tuple(getattr(args, "seams", None) or (1,))
    from kvruntime.ops.blend import probe_layer_of
    for p in probes:
        probe_layer_of(p, 30)                      # the syntax; the layer is checked against the model below
    if any(s < 0 for s in seams):
        raise ValueError("--seams must be >= 0")
    if getattr(args, "answered", False) and getattr(args, "unanswered", False):
        raise ValueError("--answered and --unanswered exclude each other")
    if getattr(args, "from_rows", None):
        return _sweep_from_rows(args, argv)
    started = time.monotonic()
    engine = ReferenceEngine(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    if not engine.rope.enabled:
        raise RuntimeError(f"RoPE self-test failed (error {engine.rope.self_test_error}); cannot evaluate reposition")
    compose_only = getattr(args, "compose_only", False)
    compose_cases = load_compose_cases()
    if getattr(args, "answered", False):
        compose_cases = [c for c in compose_cases if c.answers]
    if getattr(args, "unanswered", False):
        compose_cases = [c for c in compose_cases if not c.answers]
    compose_cases = compose_cases[: args.limit]
    edit_cases = [] if compose_only else load_edit_cases()[: args.limit]
    if compose_only:
        for p in probes:
            probe_layer_of(p, engine.num_layers)
        return _compose_sweep(args, argv, engine, compose_cases, ratios, started, probes, seams)
    decisions = _decisions(args)
    print(f"kvnotes: fidelity of {args.model}: {len(compose_cases)} compose cases, {decisions} decision cases, "
          f"{len(edit_cases)} edit cases{'' if args.no_cot else ' (+ CoT variant)'}", file=sys.stderr)
    compose_rows = run_compose(engine, compose_cases, load_passages())
    decision_rows = run_decisions(engine, decisions, COMPOSE_OPS)
    edit_rows, informative = run_edit(engine, edit_cases)
    cot_rows, cot_inf = ({}, {}) if args.no_cot else run_edit(engine, edit_cases, cot=True, greedy_n=32)
    meta = {
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "command": "kvnotes " + " ".join(_without_option(argv, "--tables-dir")),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {__import__('torch').get_num_threads()}",
        "seconds": time.monotonic() - started,
        "cases": {"compose": len(compose_cases), "decision": decisions, "edit": len(edit_cases),
                  "informative": sum(informative.values()), "cot_informative": sum(cot_inf.values())},
    }
    summary = report.build_summary(meta, compose_rows, edit_rows, informative, cot_rows, cot_inf)
    summary["compose_answers"] = answers_from_runs(meta, compose_rows, decision_rows)
    tables_dir = Path(args.tables_dir) if args.tables_dir else report.TABLES_DIR
    previous = report.load_summary(args.model, tables_dir) or {}
    if previous.get("compose_sweep"):              # kept: a full run does not re-measure the r sweep
        summary["compose_sweep"] = previous["compose_sweep"]
    path = report.save_summary(args.model, summary, tables_dir)
    print(report.render_markdown(summary))
    print(f"kvnotes: summary written to {path}", file=sys.stderr)
    return 0


def _compose_sweep(args, argv, engine, cases, ratios, started, probes=("kv1",), seams=(1,)) -> int:
    """``--compose-only``: the compose operations plus one selective recompute per ratio, merged
    into the model's existing summary under ``compose_sweep`` (the other sections are kept). The
    r = 0 row is "reposition + seam 1"; naive splice and seam 4 are in the full run's table."""
    print(f"kvnotes: compose sweep of {args.model}: {len(cases)} cases, ratios {list(ratios)}", file=sys.stderr)
    ops = {k: v for k, v in compose_ops(ratios, probes, seams).items()
           if k in ("reposition + seam 1", "reposition + seam 4") and v["seam_tokens"] in seams or v.get("recompute_ratio")}
    decisions = _decisions(args)
    rows_out = open(args.rows_out, "w") if getattr(args, "rows_out", None) else None
    try:
        rows = run_compose(engine, cases, load_passages(), ops=ops, rows_out=rows_out)
    finally:
        if rows_out is not None:
            rows_out.close()
    decision_rows = run_decisions(engine, decisions, ops)
    meta = {"model": args.model, "dtype": args.dtype, "device": args.device,
            "command": "kvnotes " + " ".join(_without_option(argv, "--tables-dir")),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {__import__('torch').get_num_threads()}",
            "seconds": time.monotonic() - started, "cases": {"compose": len(cases), "decision": decisions}}
    tables_dir = Path(args.tables_dir) if args.tables_dir else report.TABLES_DIR
    summary = report.load_summary(args.model, tables_dir) or {"meta": meta}
    if summary.get("compose"):
        summary["compose"] = report.with_params(summary["compose"])
    summary["compose_sweep"] = report.build_sweep(meta, rows, ops)
    summary["compose_answers"] = answers_from_runs(meta, rows, decision_rows)
    path = report.save_summary(args.model, summary, tables_dir)
    print(report.render_markdown(summary))
    print(f"kvnotes: summary written to {path}", file=sys.stderr)
    return 0


def _sweep_from_rows(args, argv) -> int:
    """``--from-rows``: the ``compose_sweep`` section rebuilt from per-case rows (several runs,
    e.g. answered and unanswered cases measured apart), merged into the model's summary."""
    for f in args.from_rows:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--from-rows: {f} does not exist")
    rows = report.load_rows(args.from_rows)
    if not rows:
        raise ValueError("--from-rows: the files hold no rows")
    meta = {"model": args.model, "dtype": args.dtype, "device": args.device,
            "command": "kvnotes " + " ".join(_without_option(argv, "--tables-dir")),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "seconds": None}
    tables_dir = Path(args.tables_dir) if args.tables_dir else report.TABLES_DIR
    summary = report.load_summary(args.model, tables_dir) or {"meta": meta}
    summary["compose_sweep"] = report.sweep_from_rows(meta, rows)
    path = report.save_summary(args.model, summary, tables_dir)
    print(report.render_markdown(summary))
    print("#### Agreement with 95% intervals, near ties, answers paired with recompute\n\n"
          + report.paired_table(rows) + "\n")
    print("#### Top-1 flips\n\n" + report.flips_table(rows))
    print(f"kvnotes: summary written to {path}", file=sys.stderr)
    return 0


def _decisions(args) -> int:
    """Yes/no decision cases to run (``--decisions``, capped by ``--limit``; 0 with --unanswered)."""
    n = getattr(args, "decisions", None)
    n = DEFAULT_DECISIONS if n is None else n
    if n < 0 or n > DECISION_CASES:
        raise ValueError(f"--decisions must be in 0..{DECISION_CASES}, got {n}")
    if getattr(args, "unanswered", False):
        return 0
    return min(n, args.limit) if args.limit is not None else n


def _without_option(argv: list[str], opt: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == opt:
            skip = True
        elif not a.startswith(opt + "="):
            out.append(a)
    return out


def write_report(doc: str) -> int:
    path = Path(doc)
    if not path.exists():
        raise FileNotFoundError(f"{doc} does not exist")
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc} has no generated-section markers ({BEGIN} ... {END})")
    sections = []
    for f in sorted(report.TABLES_DIR.glob("*.json")):
        sections.append(report.render_markdown(report.load_summary(f.stem)))
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + "\n".join(sections) + "\n" + END + tail)
    print(f"kvnotes: wrote {len(sections)} model section(s) into {doc}", file=sys.stderr)
    return 0
