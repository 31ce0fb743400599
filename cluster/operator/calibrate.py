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

Resumable: every finished case is appended (one JSON line, fsync'd) to ``rows.jsonl`` in a run
directory keyed by the checkpoint's content hash, dtype, the case ids and the operations
(:func:`run_key`; default ``$KVNOTES_CACHE/calibrate/<model>-<key>``). A killed run, started
again with the same arguments, loads the finished cases and measures only the rest; the profile
is the same as an uninterrupted run's (apart from wall times). A progress bar on stderr shows
the cases done and an ETA (the mean time per case so far times the cases left).

Cases run one at a time through the reference engine, which prefills and decodes one sequence
per forward. Several cases per forward are not built: that needs a padded batched prefill and
decode in the engine, and its gain on CPU (where a forward over a few hundred tokens is already
matrix-matrix work) has not been measured yet (docs/fidelity.md, "Calibrating a model").
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from cluster.control.compose_choice import choose_edits_by_answers
from cluster.control.planner import FidelityTarget, choose_compose, choose_edit_kind


EDIT_KEY = {"edit answers": {"reference": True}}   # edit rows judged, with recompute's (run key)
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


def run_key(content_hash: str, dtype: str, case_ids: dict[str, list[str]], ops: dict) -> str:
    """What a run directory is keyed by: the weights, dtype, case ids per set and operations."""
    blob = json.dumps({"weights": content_hash, "dtype": dtype, "cases": case_ids,
                       "ops": {k: ops[k] for k in sorted(ops)}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RunLog:
    """The run directory's ``rows.jsonl``: one line per finished case, appended and fsync'd."""

    def __init__(self, directory: Path, key_doc: dict):
        self.dir = directory
        from kvruntime.private_files import private_dir
        private_dir(self.dir)             # the cases' texts and answers: mode 0700 (warned if looser)
        meta = self.dir / "run.json"
        if meta.exists() and json.loads(meta.read_text()) != key_doc:
            raise ValueError(f"{self.dir} holds another calibration run (other model, cases or operations); "
                             "pass another --run-dir")
        meta.write_text(json.dumps(key_doc, indent=1, sort_keys=True))
        self.path = self.dir / "rows.jsonl"
        self.done: dict[tuple[str, str], dict] = {}
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            for i, line in enumerate(lines):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines) - 1:
                        break                      # the line a kill cut short: measured again
                    raise ValueError(f"{self.path}: line {i + 1} is not JSON; remove the run directory")
                self.done[rec["set"], rec["case"]] = rec
            self._rewrite_clean()
        self._f = open(self.path, "a")

    def _rewrite_clean(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for rec in self.done.values():
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done[rec["set"], rec["case"]] = rec

    def close(self) -> None:
        self._f.close()


def default_run_dir(name: str, key: str) -> Path:
    from kvruntime.checkpoint import cache_root
    return cache_root() / "calibrate" / f"{name}-{key}"


def check_device(device: str) -> None:
    """``--device``: cpu, or cuda[:N] on a machine whose torch sees that GPU (one-line error otherwise)."""
    import torch
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA device is visible to torch "
                           f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
    idx = int(device.split(":", 1)[1]) if ":" in device else 0
    if idx >= torch.cuda.device_count():
        raise RuntimeError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")


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


def calibrate(model: str, *, cases: int | None = None, decisions: int | None = None, out: str | None = None,
              dtype: str = "float32", device: str = "cpu", threads: int | None = None,
              target: FidelityTarget | None = None, command: str = "", stream=sys.stdout,
              run_dir: str | None = None, budget: float | None = None, progress: bool = True) -> dict:
    """Measure and save ``model``'s profile; returns ``{"path", "summary", "balanced", "edit",
    "run_dir"}``. ``target``: ``balanced``'s (default :meth:`FidelityTarget.answers`);
    ``decisions``: yes/no cases (default 20, capped by ``cases``); ``budget``: a 95% interval
    half-width that picks the compose and decision case counts (:func:`cases_for_budget`; not
    with ``cases``/``decisions``); ``run_dir``: where finished cases are logged (resume)."""
    from kvruntime.fidelity.cases import DECISION_CASES, load_compose_cases, load_decision_cases, load_edit_cases, \
        load_passages
    from kvruntime.fidelity.methods import method_name
    from kvruntime.fidelity.runner import BLEND_RATIOS, REFERENCE_OP, compose_ops
    from kvruntime.models import get_model_spec

    check_device(device)
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
    target = target or FidelityTarget.answers()
    spec = get_model_spec(model)                  # refused architectures: one line, nothing loaded
    compose_cases, edit_cases = every_compose[:cases], load_edit_cases()[:cases]
    dec_cases, dec_passages = load_decision_cases(decisions) if decisions else ([], {})
    passages = load_passages()
    ops = {**compose_ops(BLEND_RATIOS),
           **compose_ops([r for r in BLEND_RATIOS if r <= target.max_ratio], ("qlate", "qlast"))}
    dec_ops = {k: v for k, v in ops.items() if v.get("recompute_ratio", 0.0) <= target.max_ratio
               and method_name(k) not in (None, REFERENCE_OP)}
    case_ids = {"compose": [c.id for c in compose_cases], "decision": [c.id for c in dec_cases],
                "edit": [c.id for c in edit_cases]}
    key = run_key(spec.content_hash, dtype, case_ids, {**ops, **EDIT_KEY})
    log = RunLog(Path(run_dir) if run_dir else default_run_dir(spec.name, key),
                 {"model": spec.name, "content_hash": spec.content_hash, "dtype": dtype, "key": key})
    total = sum(len(v) for v in case_ids.values())
    print(f"kvnotes: calibrating {spec.name} ({dtype}, {device}): {len(compose_cases)} compose cases, "
          f"{len(dec_cases)} decision cases, {len(edit_cases)} edit cases; run log {log.path}"
          + (f" (resuming: {len(log.done)} of {total} cases done)" if log.done else ""), file=sys.stderr)
    bar = _bar(total, len(log.done), progress)
    try:
        if len(log.done) < total:
            engine = _engine(spec, dtype, device, threads)
            _measure(engine, log, bar, compose_cases, dec_cases, edit_cases, passages, dec_passages, ops, dec_ops)
    finally:
        bar.close()
        log.close()
    rows = _rows(log, "compose", case_ids["compose"])
    decision_rows = _rows(log, "decision", case_ids["decision"])
    edit_rows = _rows(log, "edit", case_ids["edit"])
    informative = {c: log.done["edit", c]["informative"] for c in case_ids["edit"]}
    return _finish(spec, model, dtype, device, command, log, case_ids, informative, rows, decision_rows,
                   edit_rows, ops, target, out, stream)


def _bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm
    # smoothing=0: the ETA is the mean time per case measured in this run times the cases left
    return tqdm(total=total, initial=done, unit="case", desc="calibrate", file=sys.stderr, smoothing=0,
                disable=not enabled, dynamic_ncols=True,
                bar_format="{desc}: {n}/{total} cases |{bar}| {elapsed} elapsed, ETA {remaining} "
                           "({rate_inv_fmt}){postfix}")


def _engine(spec, dtype: str, device: str, threads: int | None):
    from kvruntime.engine import ReferenceEngine
    engine = ReferenceEngine(spec, dtype=dtype, device=device, threads=threads)
    if not engine.rope.enabled:
        raise RuntimeError(f"model {spec.name}: RoPE self-test failed (error {engine.rope.self_test_error}); "
                           "repositioning is disabled for it, so there is nothing to calibrate")
    print(f"kvnotes: {spec.name} loaded on {engine.device} ({dtype}); RoPE self-test passed "
          f"(relative error {engine.rope.self_test_error:.2e})", file=sys.stderr)
    return engine


def _measure(engine, log: RunLog, bar, compose_cases, dec_cases, edit_cases, passages, dec_passages, ops,
             dec_ops, edit_ops=None) -> None:
    from kvruntime.fidelity.runner import run_compose, run_edit
    quiet = lambda _msg: None          # noqa: E731 - the bar reports progress
    last = [time.monotonic(), time.process_time()]

    def record(kind):
        def on_case(case, rows, informative=None):
            now, cpu = time.monotonic(), time.process_time()
            # cpu_s: this process's CPU time for the case (1 thread: the case's wall time on an idle core)
            rec = {"set": kind, "case": case.id, "rows": rows, "wall_s": now - last[0], "cpu_s": cpu - last[1]}
            if informative is not None:
                rec["informative"] = informative
            log.append(rec)
            last[0], last[1] = now, cpu
            bar.set_postfix_str(f"{kind} {case.id}", refresh=False)
            bar.update(1)
        return on_case

    todo = [c for c in compose_cases if ("compose", c.id) not in log.done]
    if todo:
        run_compose(engine, todo, passages, ops=ops, progress=quiet, share_probe=False, on_case=record("compose"))
    todo = [c for c in dec_cases if ("decision", c.id) not in log.done]
    if todo:
        run_compose(engine, todo, {**passages, **dec_passages}, ops=dec_ops, progress=quiet, share_probe=False,
                    on_case=record("decision"))
    todo = [c for c in edit_cases if ("edit", c.id) not in log.done]
    if todo:
        run_edit(engine, todo, progress=quiet, on_case=record("edit"), ops=edit_ops, reference=True)


def _rows(log: RunLog, kind: str, ids: list[str]) -> dict[str, list[dict]]:
    """Per op, the logged rows of ``kind`` in case order (as one uninterrupted run orders them)."""
    out: dict[str, list[dict]] = {}
    for cid in ids:
        for op, row in log.done[kind, cid]["rows"].items():
            out.setdefault(op, []).append(row)
    return out


def _finish(spec, model, dtype, device, command, log, case_ids, informative, rows, decision_rows, edit_rows,
            ops, target, out, stream) -> dict:
    import torch

    from kvruntime.fidelity.edit_answers import edit_answers_section
    from kvruntime.fidelity.methods import answers_section, as_method_rows
    from kvruntime.fidelity.runner import COMPOSE_OPS, REFERENCE_OP

    from kvruntime.fidelity.profiles import write_profile
    from kvruntime.fidelity.report import build_summary, build_sweep
    meta = {"model": spec.name, "checkpoint": spec.checkpoint, "content_hash": spec.content_hash, "dtype": dtype,
            "device": device, "command": command or f"kvnotes calibrate --model {model}",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "seconds": sum(r.get("wall_s", 0.0) for r in log.done.values()),
            "cpu_seconds": sum(r.get("cpu_s", 0.0) for r in log.done.values()),
            "cases": {"compose": len(case_ids["compose"]), "decision": len(case_ids["decision"]),
                      "edit": len(case_ids["edit"]), "informative": sum(informative.values())}}
    fixed = {op: r for op, r in rows.items() if op in COMPOSE_OPS or op == REFERENCE_OP}
    summary = build_summary(meta, fixed, {op: r for op, r in edit_rows.items() if op != REFERENCE_OP},
                            informative, {}, {})
    summary["edit_answers"] = edit_answers_section(edit_rows, informative, meta)
    summary["compose_sweep"] = build_sweep(meta, {op: r for op, r in rows.items() if op not in fixed
                                                  or op in (REFERENCE_OP, "reposition + seam 1")}, ops)
    summary["compose_answers"] = answers_section(as_method_rows(rows, decision_rows), meta)
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
    _print_edit_verdicts(summary, target, spec.name, stream)
    return {"path": path, "summary": summary, "balanced": balanced, "edit": edit, "run_dir": log.dir}


def _print_edit_verdicts(summary: dict, target: FidelityTarget, model: str, stream) -> None:
    for v in choose_edits_by_answers(summary, target, model=model):
        print(f"kvnotes: {v.kind.value} under balanced: {'planned' if v.allowed else 'recomputed'} ({v.reason})",
              file=stream)


def calibrate_edits(model: str, *, cases: int | None = None, out: str | None = None, dtype: str = "float32",
                    device: str = "cpu", threads: int | None = None, target: FidelityTarget | None = None,
                    command: str = "", stream=None, run_dir: str | None = None, progress: bool = True) -> dict:
    """``kvnotes calibrate --edits-only``: measure only the field edits the planner plans (and the
    stale baseline), judged against a recompute (``run_edit(reference=True)``), and write the
    section ``edit_answers`` into the model's existing profile (the other sections are kept).
    Resumable like :func:`calibrate`. Returns ``{"path", "section", "verdicts", "run_dir"}``."""
    from kvruntime.fidelity.cases import load_edit_cases
    from kvruntime.fidelity.profiles import profile_path
    from kvruntime.fidelity.report import load_summary
    from kvruntime.fidelity.runner import ANSWER_EDIT_OPS, run_edit
    from kvruntime.models import get_model_spec

    check_device(device)
    if cases is not None and cases <= 0:
        raise ValueError("--cases must be a positive number of cases")
    target, stream = target or FidelityTarget.answers(), stream or sys.stdout
    spec = get_model_spec(model)
    path = profile_path(spec, out)
    summary = load_summary(path.stem, path.parent)
    if summary is None:
        raise ValueError(f"--edits-only adds to a profile: none at {path} (run `kvnotes calibrate --model {model}` "
                         "first, or pass --out the directory holding it)")
    edit_cases = load_edit_cases()[:cases]
    case_ids = {"edit": [c.id for c in edit_cases]}
    key = run_key(spec.content_hash, dtype, case_ids, {"edits only": list(ANSWER_EDIT_OPS), **EDIT_KEY})
    log = RunLog(Path(run_dir) if run_dir else default_run_dir(spec.name, key),
                 {"model": spec.name, "content_hash": spec.content_hash, "dtype": dtype, "key": key})
    print(f"kvnotes: calibrating the edits of {spec.name} ({dtype}, {device}): {len(edit_cases)} edit cases; "
          f"run log {log.path}" + (f" (resuming: {len(log.done)} done)" if log.done else ""), file=sys.stderr)
    bar = _bar(len(edit_cases), len(log.done), progress)
    try:
        todo = [c for c in edit_cases if ("edit", c.id) not in log.done]
        if todo:
            engine = _engine(spec, dtype, device, threads)
            _measure(engine, log, bar, [], [], todo, {}, {}, {}, {}, edit_ops=ANSWER_EDIT_OPS)
    finally:
        bar.close()
        log.close()
    return _finish_edits(spec, summary, log, case_ids, dtype, device, command or f"kvnotes calibrate --model {model} "
                         "--edits-only", target, out, stream)


def _finish_edits(spec, summary, log, case_ids, dtype, device, command, target, out, stream) -> dict:
    import torch

    from kvruntime.fidelity.edit_answers import edit_answers_section
    from kvruntime.fidelity.profiles import write_profile
    rows = _rows(log, "edit", case_ids["edit"])
    informative = {c: log.done["edit", c]["informative"] for c in case_ids["edit"]}
    recs = [log.done["edit", c] for c in case_ids["edit"]]
    meta = {"model": spec.name, "dtype": dtype, "device": device, "command": command,
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "seconds": sum(r.get("wall_s", 0.0) for r in recs), "cpu_seconds": sum(r.get("cpu_s", 0.0) for r in recs)}
    section = edit_answers_section(rows, informative, meta)
    path = write_profile(spec, {**summary, "edit_answers": section}, out)
    print(f"kvnotes: edit answers of {spec.name} written to {path} ({meta['seconds']:.0f} s measuring, "
          f"{meta['cpu_seconds']:.0f} s CPU, {len(recs)} cases, {section['meta']['cases']['informative']} "
          f"informative; run log {log.path})", file=stream)
    _print_edit_verdicts({"edit_answers": section}, target, spec.name, stream)
    return {"path": path, "section": section, "verdicts": choose_edits_by_answers({"edit_answers": section}, target,
                                                                                 model=spec.name),
            "run_dir": log.dir}
