"""``kvnotes calibrate`` as a user runs it: resumable after a kill, a progress bar with an ETA,
``--budget`` and ``--device`` (on a tiny random-weight checkpoint: tests/tiny_checkpoints.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster.operator.calibrate import cases_for_budget, split_budget, wilson_half_width

TIMING = {"seconds", "seconds_mean", "cpu_seconds", "wall_s", "cpu_s", "ms_per_request", "ms_recompute", "ms",
          "ref_ms", "date", "command"}


def _untimed(x):
    """A profile without its wall times (and date/command): what two runs of the same cases share."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def _cmd(ckpt, out, run_dir):
    return [sys.executable, "-m", "cluster.operator.cli", "calibrate", "--model", str(ckpt), "--cases", "2",
            "--decisions", "1", "--out", str(out), "--run-dir", str(run_dir), "--threads", "1"]


def _records(path):
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass                                   # the line the kill cut short
    return out


def test_a_killed_calibration_resumes_and_gives_the_uninterrupted_profile(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints["llama3"]
    total = 2 + 1 + 2                               # compose + decision + edit cases
    whole = subprocess.run(_cmd(ckpt, tmp_path / "a", tmp_path / "run-a"), capture_output=True, text=True,
                           timeout=1500)
    assert whole.returncode == 0, whole.stderr[-2000:]
    # the progress bar: cases done of the total, elapsed and an ETA, on stderr
    assert f"calibrate: {total}/{total} cases" in whole.stderr and "ETA" in whole.stderr, whole.stderr[-2000:]
    assert "balanced will" in whole.stdout and "x" in whole.stdout

    run_b = tmp_path / "run-b"
    proc = subprocess.Popen(_cmd(ckpt, tmp_path / "b", run_b), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 1500
    while len(_records(run_b / "rows.jsonl")) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL     # killed mid-run, not finished
    before = _records(run_b / "rows.jsonl")
    assert 2 <= len(before) < total, len(before)
    assert not (tmp_path / "b").exists()                # no profile from a killed run

    again = subprocess.run(_cmd(ckpt, tmp_path / "b", run_b), capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming: {len(before)} of {total} cases done" in again.stderr, again.stderr[-2000:]
    after = _records(run_b / "rows.jsonl")
    assert len(after) == total and len({(r["set"], r["case"]) for r in after}) == total
    assert after[:len(before)] == before                # finished cases kept as measured, not redone

    name = next((tmp_path / "a").glob("*.json")).name
    a = json.loads((tmp_path / "a" / name).read_text())
    b = json.loads((tmp_path / "b" / name).read_text())
    assert a["meta"]["cases"] == b["meta"]["cases"] == {"compose": 2, "decision": 1, "edit": 2,
                                                         "informative": a["meta"]["cases"]["informative"]}
    assert _untimed(a) == _untimed(b)

    # a run directory of other cases is refused, not mixed in
    other = _cmd(ckpt, tmp_path / "c", run_b)
    other[other.index("--cases") + 1] = "1"
    res = subprocess.run(other, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "holds another calibration run" in res.stderr, res.stderr[-1000:]


def test_budget_picks_the_fewest_cases_for_the_interval():
    n = cases_for_budget(0.05, 130)
    assert wilson_half_width(n) <= 0.05 < wilson_half_width(n - 1)
    comp, dec = split_budget(n, 90, 40)
    assert comp + dec == n and 0 < dec <= 40 and comp <= 90
    assert split_budget(130, 90, 40) == (90, 40)
    with pytest.raises(ValueError, match="reach a half-width"):
        cases_for_budget(0.01, 130)
    with pytest.raises(ValueError, match="half-width in"):
        cases_for_budget(0.7, 130)


def test_device_cuda_without_a_gpu_is_one_line_error(monkeypatch, capsys, tmp_path):
    import torch

    from cluster.operator.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["calibrate", "--model", "smollm2-135m", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no CUDA device" in err[0], err
    rc = main(["calibrate", "--model", "smollm2-135m", "--device", "tpu", "--out", str(tmp_path)])
    assert rc == 2 and "--device must be cpu or cuda" in capsys.readouterr().err
    rc = main(["calibrate", "--model", "smollm2-135m", "--budget", "0.05", "--cases", "3", "--out", str(tmp_path)])
    assert rc == 2 and "--budget picks the case counts" in capsys.readouterr().err


def test_edits_only_adds_the_answer_level_edit_rows_to_an_existing_profile(tiny_checkpoints, tmp_path, capfd):
    """``--edits-only``: the planned edit operations (and the stale baseline) measured on the edit
    cases, judged against a recompute, written as section ``edit_answers`` into the model's
    profile, every other section kept; the verdicts balanced will apply are printed. No profile to
    add to: a one-line error."""
    from cluster.operator.cli import main
    from kvruntime.fidelity.profiles import profile_path
    from kvruntime.models import get_model_spec
    ckpt = tiny_checkpoints["llama3"]
    out = tmp_path / "profiles"
    argv = ["calibrate", "--model", str(ckpt), "--edits-only", "--cases", "3", "--out", str(out), "--threads", "1",
            "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2 and "--edits-only adds to a profile" in capfd.readouterr().err
    path = profile_path(get_model_spec(str(ckpt)), out)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": {"model": "tiny"}, "compose_answers": {"ops": {"x": {"n": 1}}}}))
    assert main(argv) == 0
    printed = capfd.readouterr().out
    assert "edit_in_place under balanced: recomputed" in printed and "only 3 cases measured" in printed
    prof = json.loads(path.read_text())
    assert prof["compose_answers"] == {"ops": {"x": {"n": 1}}} and prof["meta"] == {"model": "tiny"}
    sec = prof["edit_answers"]
    assert set(sec["ops"]) == {"stale (no fix)", "field + top-16", "erratum: correction"}
    row = sec["ops"]["field + top-16"]
    assert row["n"] == 3 and row["params"] == {"edit": "edit_in_place", "top_k": 16}
    assert row["answered"] + row["decision_n"] == 3          # each case judged: a lookup answer or a yes/no decision
    assert 0.0 <= row["top1"] <= 1.0 and len(row["top1_ci"]) == 2 and row["ms_recompute"] > 0
    assert sec["meta"]["cases"]["lookup"] + sec["meta"]["cases"]["derived"] == 3
