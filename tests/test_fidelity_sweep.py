"""The compose r sweep and answer judging of the fidelity harness."""
import json
import math
import subprocess
import sys

import pytest

from kvruntime.fidelity import report
from kvruntime.fidelity.cases import load_compose_cases, load_passages
from kvruntime.fidelity.metrics import answer_correct, summarize
from kvruntime.fidelity.runner import REFERENCE_OP, blend_op


def test_confusing_cases_carry_answers_found_in_exactly_one_chunk():
    passages = load_passages()
    judged = [c for c in load_compose_cases() if c.answers]
    assert len(judged) >= 20
    for c in judged:
        holders = [p for p in c.chunks if any(answer_correct(passages[p], [a]) for a in c.answers)]
        assert len(holders) == 1, (c.id, holders)        # the answer is in one chunk only


def test_answer_judging_is_whole_word_and_case_insensitive():
    assert answer_correct("It was founded in 2014.", ["2014"]) == 1.0
    assert answer_correct("Revenue was 610 million", ["61"]) == 0.0
    assert answer_correct("Revenue was 6.1 million", ["61"]) == 0.0
    assert answer_correct("the CEO is pekka   virtanen", ["Pekka Virtanen"]) == 1.0
    assert answer_correct("", ["x"]) == 0.0


def test_summary_reports_accuracy_only_over_judged_rows():
    rows = [dict(kl=0.1, cosine=1.0, top1=1.0, greedy_exact=0.0, greedy_prefix=0.5, recomputed_tokens=1,
                 context_tokens=2, answer_ok=v) for v in (1.0, 0.0, None, 1.0)]
    s = summarize(rows)
    assert s["answered"] == 3 and abs(s["accuracy"] - 2 / 3) < 1e-12
    text = report.table({"reposition + seam 1": s})
    assert "answer accuracy" in text and "2/3 (67%)" in text


@pytest.mark.slow
def test_compose_only_sweep_writes_a_profile_row_per_ratio(tmp_path):
    """End to end through the CLI: r = 100% reproduces full recompute (KL ~ 0, same greedy, same
    answers), and every row names the compose() parameters the planner will read."""
    r = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "eval", "fidelity", "--model", "smollm2-135m",
                        "--threads", "1", "--compose-only", "--answered", "--limit", "1", "--ratios", "0.1", "1.0",
                        "--tables-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ops = json.loads((tmp_path / "smollm2-135m.json").read_text())["compose_sweep"]["ops"]
    assert set(ops) == {REFERENCE_OP, "reposition + seam 1", blend_op(0.1), blend_op(1.0)}
    full = ops[blend_op(1.0)]
    assert full["kl_mean"] < 1e-4 and full["top1"] == 1.0 and full["greedy_exact"] == 1.0
    assert full["accuracy"] == ops[REFERENCE_OP]["accuracy"] and full["answered"] == 1
    assert ops[blend_op(0.1)]["params"] == {"rotate": True, "seam_tokens": 1, "recompute_ratio": 0.1}
    assert ops[blend_op(0.1)]["probed_tokens_mean"] > 0
    assert ops[blend_op(1.0)]["recomputed_tokens_mean"] == ops[REFERENCE_OP]["recomputed_tokens_mean"]
    assert "| " + blend_op(0.1) + " |" in r.stdout
    ans = json.loads((tmp_path / "smollm2-135m.json").read_text())["compose_answers"]
    assert ans["meta"]["cases"] == {"compose": 1, "decision": 1}           # --limit caps the decision cases too
    assert set(ans["ops"]) == {REFERENCE_OP, "bos | seam 1", "bos | kv1 10%", "bos | kv1 100%"}
    one = ans["ops"]["bos | kv1 100%"]
    assert one["n"] == 2 and one["decision_n"] == 1 and one["answered"] == 2 and one["top1"] == 1.0
    assert one["drop_bound"] is not None and one["chunk_share"] == 1.0 and one["decision"] == 1.0


def test_bad_ratio_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "eval", "fidelity", "--compose-only", "--ratios", "1.5"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--ratios" in r.stderr


def test_sweep_from_rows_merges_runs_and_lists_flips(tmp_path):
    base = dict(kl=0.1, cosine=1.0, greedy_exact=0.0, greedy_prefix=0.5, recomputed_tokens=10, context_tokens=100)
    rows = [
        {"op": REFERENCE_OP, "case": "a", "top1": 1.0, "answer_ok": 1.0, "oracle_margin": 0.02, **base},
        {"op": "reposition + seam 1", "case": "a", "top1": 0.0, "answer_ok": 0.0, "oracle_margin": 0.02, **base},
        {"op": blend_op(0.1, probe="progressive"), "case": "a", "top1": 0.0, "oracle_margin": 0.02, **base},
        {"op": "reposition + seam 1", "case": "b", "top1": 1.0, "oracle_margin": 3.0, **base},
        {"op": blend_op(0.1, probe="progressive"), "case": "b", "top1": 1.0, "oracle_margin": 3.0, **base},
        {"op": "reposition + seam 1", "case": "c", "top1": 1.0, "oracle_margin": 2.0, **base},   # c: one op only
    ]
    (tmp_path / "one.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n")
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(r) for r in rows[3:]) + "\n")
    loaded = report.load_rows([tmp_path / "one.jsonl", tmp_path / "two.jsonl"])
    sweep = report.sweep_from_rows({"model": "m"}, loaded)
    ops = sweep["ops"]
    assert ops["reposition + seam 1"]["n"] == 2 and ops["reposition + seam 1"]["top1"] == 0.5   # a, b (c not common)
    assert ops[REFERENCE_OP]["n"] == 1                                     # the reference exists for answered cases only
    assert ops[blend_op(0.1, probe="progressive")]["params"] == {
        "rotate": True, "seam_tokens": 1, "recompute_ratio": 0.1, "probe": "progressive"}
    flips = report.flips_table(loaded)
    assert "| a | 0.020 | 2/2:" in flips and "| b |" not in flips
    with pytest.raises(ValueError):
        report.params_of("something else")
    paired = report.paired_table(loaded)
    # seam 1 on the common cases a, b: one flip (a, margin 0.02 < 0.1, not < 0.001); answers:
    # a judged for seam 1 (wrong) and recompute (right) -> 0/1 right (1/1), lost 1, gained 0
    assert "| reposition + seam 1 | 2 | 1/2 = 50% (9%-91%) | 0/2 = 0% (0%-66%) | 1 | 0 / 1 | 0/1 (1/1) | 1 / 0 |" in paired, paired
    assert f"| {blend_op(0.1, probe='progressive')} | 2 | 1/2 = 50%" in paired and "n/a | n/a |" in paired


def test_wilson_interval():
    lo, hi = report.wilson(87, 90)
    assert 0.90 < lo < 0.91 and 0.98 < hi < 0.995          # 97% observed on 90 cases: [90.6%, 98.9%]
    assert report.wilson(0, 10)[0] == 0.0 and report.wilson(10, 10)[1] == 1.0
    assert all(math.isnan(x) for x in report.wilson(0, 0))


@pytest.mark.parametrize("argv,needle", [
    (["--probes", "attention"], "probe must be"),
    (["--probes", "kv0"], "probe layer"),
    (["--answered", "--unanswered"], "exclude each other"),
    (["--from-rows", "/nonexistent/rows.jsonl"], "does not exist"),
])
def test_bad_sweep_options_are_one_line_errors(argv, needle):
    r = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "eval", "fidelity", "--compose-only", *argv],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr[-500:]


def _rows(op, kind, vals, **kw):
    return [dict(op=op, case=f"{kind[0]}{i}", kind=kind, kl=0.01, cosine=1.0, top1=t, greedy_exact=g,
                 greedy_prefix=1.0, recomputed_tokens=10, context_tokens=100, chunk_tokens=80,
                 chunk_recomputed=80 if op == REFERENCE_OP else 8, seconds=0.5, answer_ok=a,
                 **({"decision_agree": d} if kind == "decision" else {}), **kw)
            for i, (t, g, a, d) in enumerate(vals)]


def test_compose_answers_section_from_rows_counts_intervals_and_the_paired_bound(tmp_path):
    """``methods --from-rows --profile-out``: per op its parameters, top-1 / greedy / decision
    agreement with Wilson intervals, answers paired with recompute's (Newcombe bound), measured
    chunk share; written into the profile next to its other sections."""
    from kvruntime.fidelity.methods import main, newcombe_paired_upper
    from kvruntime.fidelity.report import wilson
    ref = _rows(REFERENCE_OP, "compose", [(1, 1, 1, 0)] * 6 + [(1, 1, 0, 0)] * 4) \
        + _rows(REFERENCE_OP, "decision", [(1, 1, 1, 1)] * 5)
    op = _rows("bos | qlate 10%", "compose", [(1, 0, 1, 0)] * 5 + [(0, 0, 0, 0)] + [(1, 1, 1, 0)] + [(1, 0, 0, 0)] * 3) \
        + _rows("bos | qlate 10%", "decision", [(1, 1, 1, 1)] * 4 + [(0, 0, 0, 0)])
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ref + op) + "\n")
    prof = tmp_path / "m.json"
    prof.write_text(json.dumps({"meta": {"model": "m"}, "compose": {"x": {"n": 1}}}))
    assert main(["--model", "m", "--from-rows", str(f), "--profile-out", str(prof)]) == 0
    out = json.loads(prof.read_text())
    assert out["compose"] == {"x": {"n": 1}}                                 # other sections kept
    sec = out["compose_answers"]
    assert sec["meta"]["cases"] == {"compose": 10, "decision": 5} and "--profile-out" in sec["meta"]["command"]
    row = sec["ops"]["bos | qlate 10%"]
    assert row["params"] == {"compile": "bos", "rotate": True, "seam_tokens": 1, "recompute_ratio": 0.1,
                             "probe": "qlate"}
    assert row["n"] == 15 and row["top1"] == 13 / 15 and row["top1_ci"] == list(wilson(13, 15))
    assert row["greedy16"] == 5 / 15 and row["greedy16_ci"] == list(wilson(5, 15))
    assert (row["decision_n"], row["decision"], row["decision_ci"]) == (5, 0.8, list(wilson(4, 5)))
    # pairs (recompute, op), by hand from the rows above
    a = 5 + 4                         # both right: x0-x4, d0-d3
    b = 1 + 1                         # recompute right, op wrong: x5, d4
    c = 1                             # op right, recompute wrong: x6
    d = 3                             # both wrong: x7-x9
    assert row["answered"] == 15 and row["lost"] == b and row["gained"] == c
    assert row["accuracy"] == (a + c) / 15 and row["accuracy_recompute"] == (a + b) / 15
    assert row["drop_bound"] == newcombe_paired_upper(a, b, c, d) and row["drop_bound"] > 2 / 15
    assert row["chunk_share"] == 0.1 and row["ms_per_request"] == 500.0
    assert sec["ops"][REFERENCE_OP]["params"] == {"recompute": True} and sec["ops"][REFERENCE_OP]["drop_bound"] is None
    with pytest.raises(ValueError, match="profile of m"):
        main(["--model", "other", "--from-rows", str(f), "--profile-out", str(prof)])


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_shipped_compose_answers_is_what_its_command_computes_from_the_shipped_rows(model):
    """The section in the shipped table is reproducible: its meta names the command and the rows
    files, and recomputing it from those rows gives the same numbers."""
    from pathlib import Path

    from kvruntime.fidelity.methods import answers_section, fill_chunk_counts, load_sources
    from kvruntime.fidelity.report import load_summary
    sec = load_summary(model)["compose_answers"]
    root = Path(__file__).resolve().parents[1]
    meta = sec["meta"]
    assert meta["model"] == model and (meta["rows"] or meta.get("calibrate_rows")) and "--profile-out" in meta["command"]
    cal = meta.get("calibrate_rows")
    rows = load_sources([root / p for p in meta["rows"]], root / cal if cal else None)
    again = answers_section(fill_chunk_counts(rows, model), {})
    assert again["meta"]["cases"] == sec["meta"]["cases"]
    assert json.loads(json.dumps(again["ops"])) == sec["ops"]
    for name, row in sec["ops"].items():         # measured chunk share: r plus the seams (frame: first chunk exact)
        r = row["params"].get("recompute_ratio", 1.0)
        assert row["chunk_share"] is not None and (r <= row["chunk_share"] <= r + 0.08 or name.startswith("frame")), name
