"""``kvnotes calibrate --edits-only``: the field edits the planner plans, measured alone and added to
a model's existing profile as section ``edit_answers`` (``kvruntime.fidelity.edit_answers``).

The planned edit operations (edit-in-place, the erratum) and the stale baseline run on the edit
cases, each judged against a recompute (``run_edit(reference=True)``), in a run directory of
their own (resumable like a full run: ``cluster.operator.calibration_run``). The verdicts
``balanced`` will apply (:func:`cluster.control.compose_choice.choose_edits_by_answers`) are printed.
"""
from __future__ import annotations

import datetime
import sys

from cluster.control.compose_choice import choose_edits_by_answers
from cluster.control.planner import FidelityTarget
from cluster.operator.calibration_run import EDIT_KEY, RunLog, check_device, load_engine, machine_line, measure, \
    progress_bar, run_key


def print_edit_verdicts(summary: dict, target: FidelityTarget, model: str, stream) -> None:
    """One line per planned edit kind: planned or recomputed under ``balanced``, and the row's reason."""
    for v in choose_edits_by_answers(summary, target, model=model):
        print(f"kvnotes: {v.kind.value} under balanced: {'planned' if v.allowed else 'recomputed'} ({v.reason})",
              file=stream)


def calibrate_edits(model: str, *, cases: int | None = None, out: str | None = None, dtype: str = "float32",
                    device: str = "cpu", threads: int | None = None, target: FidelityTarget | None = None,
                    command: str = "", stream=None, run_dir: str | None = None, progress: bool = True) -> dict:
    """Measure only the field edits and write section ``edit_answers`` into ``model``'s existing
    profile (the other sections are kept). Returns ``{"path", "section", "verdicts", "run_dir"}``."""
    from kvruntime.fidelity.cases import load_edit_cases
    from kvruntime.fidelity.profiles import profile_path
    from kvruntime.fidelity.report import load_summary
    from kvruntime.fidelity.runner import ANSWER_EDIT_OPS
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
    log = RunLog.open(spec, dtype, key, run_dir)
    print(f"kvnotes: calibrating the edits of {spec.name} ({dtype}, {device}): {len(edit_cases)} edit cases; "
          f"run log {log.path}" + (f" (resuming: {len(log.done)} done)" if log.done else ""), file=sys.stderr)
    bar = progress_bar(len(edit_cases), len(log.done), progress)
    try:
        todo = [c for c in edit_cases if ("edit", c.id) not in log.done]
        if todo:
            engine = load_engine(spec, dtype, device, threads)
            measure(engine, log, bar, [], [], todo, {}, {}, {}, {}, edit_ops=ANSWER_EDIT_OPS)
    finally:
        bar.close()
        log.close()
    return _finish_edits(spec, summary, log, case_ids, dtype, device, command or f"kvnotes calibrate --model {model} "
                         "--edits-only", target, out, stream)


def _finish_edits(spec, summary, log, case_ids, dtype, device, command, target, out, stream) -> dict:
    from kvruntime.fidelity.edit_answers import edit_answers_section
    from kvruntime.fidelity.profiles import write_profile
    rows = log.rows("edit", case_ids["edit"])
    recs = [log.done["edit", c] for c in case_ids["edit"]]
    meta = {"model": spec.name, "dtype": dtype, "device": device, "command": command,
            "date": datetime.date.today().isoformat(), "machine": machine_line(),
            "seconds": sum(r.get("wall_s", 0.0) for r in recs), "cpu_seconds": sum(r.get("cpu_s", 0.0) for r in recs)}
    section = edit_answers_section(rows, log.informative(case_ids["edit"]), meta)
    path = write_profile(spec, {**summary, "edit_answers": section}, out)
    print(f"kvnotes: edit answers of {spec.name} written to {path} ({meta['seconds']:.0f} s measuring, "
          f"{meta['cpu_seconds']:.0f} s CPU, {len(recs)} cases, {section['meta']['cases']['informative']} "
          f"informative; run log {log.path})", file=stream)
    print_edit_verdicts({"edit_answers": section}, target, spec.name, stream)
    return {"path": path, "section": section, "verdicts": choose_edits_by_answers({"edit_answers": section}, target,
                                                                                 model=spec.name),
            "run_dir": log.dir}
