"""Compile prefix x token selection sweep (which compose op meets `balanced`'s target), with intervals and the answer-based target.

    python -m kvruntime.fidelity.methods --model smollm2-135m --threads 1 --answered 24 \
        --decisions 40 --compile bos frame --methods seam1 kv1 qlast qlate --ratios 0.05 0.1 \
        --rows-out /tmp/rows.jsonl
    python -m kvruntime.fidelity.methods --model smollm2-135m --from-rows /tmp/rows.jsonl \
        --profile-out kvruntime/fidelity/tables/smollm2-135m.json

``--profile-out`` writes the section ``compose_answers`` (:func:`answers_section`) that
``balanced``'s answer target is checked against (``cluster.control.planner.choose_compose``).

Operations are named ``<compile> | <method>[ r]``: compile ``bos`` (today: after BOS alone),
``frame`` (after the model's chat frame: the first chunk after it is exact reuse), ``nl<k>``
(APE: BOS + k newlines); method ``seam<k>`` (reposition + the first k tokens of every chunk
recomputed: k = 1 is today's seam, k = 4/16 is EPIC's LegoLink-k), or a probe (``kv1``: layer-1
KV deviation; ``q...``: the question's attention, ``kvruntime.ops.qselect``) at ratio r with
seam 1. The table reports, per op: top-1 agreement, greedy-16 exact agreement and decision
agreement with recompute (95% Wilson intervals), answer accuracy paired with recompute's
(Newcombe's paired interval: one-sided 95% upper bound of the accuracy drop), chunk tokens
recomputed and mean wall time per request (compose + question, 1 thread; probes not shared).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from kvruntime.fidelity.report import load_rows
from kvruntime.fidelity.runner import REFERENCE_OP

# the statistics (newcombe_paired_upper is imported from here by callers of the sweep)
from kvruntime.fidelity.method_stats import (TARGET, _interval, meets, newcombe_paired_upper,  # noqa: F401
                                             op_stats, summary_table)


def write_section(path: Path, section: dict, model: str) -> None:
    """Put ``compose_answers`` into the profile at ``path`` (created with a meta if absent)."""
    if path.exists():
        summary = json.loads(path.read_text())
        have = (summary.get("meta") or {}).get("model")
        if have and have != model:
            raise ValueError(f"{path} is the profile of {have}, not {model}")
    else:
        summary = {"meta": {"model": model, "command": section["meta"]["command"], "dtype": "float32",
                            "device": "cpu", "date": section["meta"]["date"], "machine": "", "cases": {}}}
    summary["compose_answers"] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=lambda x: None))
    print(f"compose_answers ({len(section['ops'])} ops, cases {section['meta']['cases']}) written to {path}",
          file=sys.stderr)


def method_ops(compiles, methods, ratios) -> dict[str, dict]:
    """Op name -> compose() keyword arguments (+ ``compile``) for the grid."""
    ops: dict[str, dict] = {}
    for c in compiles:
        for m in methods:
            s = re.fullmatch(r"seam(\d+)", m)
            if s:
                ops[f"{c} | seam {int(s.group(1))}"] = dict(compile=c, rotate=True, seam_tokens=int(s.group(1)))
                continue
            for r in ratios:
                ops[f"{c} | {m} {r:.0%}"] = dict(compile=c, rotate=True, seam_tokens=1, recompute_ratio=r, probe=m)
    return ops


def answers_section(rows: dict[str, list[dict]], meta: dict) -> dict:
    """The profile section ``compose_answers`` (what ``balanced``'s answer target is checked
    against, ``cluster.control.planner.choose_compose``): per op its compose() parameters and,
    on the cases every op finished, top-1 / greedy-16 / decision agreement with recompute (each
    with its 95% Wilson interval), answer accuracy of the op and of recompute on the same judged
    cases, the one-sided 95% upper bound of the accuracy drop (Newcombe, paired), the share of
    chunk tokens recomputed (measured; None for rows written before it was recorded) and the
    median wall time per request. Each op counts every case it measured (runs with different op
    sets add up; ``n`` says how many), unlike the printed tables, which keep the common cases."""
    kinds = {r.get("kind", "compose") for rs in rows.values() for r in rs}
    ops = {}
    for op in rows:
        s = op_stats(op, rows, None)
        if s is None:
            continue
        n, pairs = s["n"], s["pairs"]
        ops[op] = {
            "params": params_of(op), "n": n, "kl_mean": s["kl"],
            "top1": s["top1"] / n, "top1_k": s["top1"], "top1_ci": _interval(s["top1"], n),
            "greedy16": s["exact"] / n, "greedy16_k": s["exact"], "greedy16_ci": _interval(s["exact"], n),
            "decision_n": s["dec_n"], "decision_k": s["dec_k"],
            "decision": s["dec_k"] / s["dec_n"] if s["dec_n"] else None,
            "decision_ci": _interval(s["dec_k"], s["dec_n"]),
            "answered": pairs, "accuracy": (s["a"] + s["c"]) / pairs if pairs else None,
            "accuracy_recompute": (s["a"] + s["b"]) / pairs if pairs else None,
            "lost": s["b"], "gained": s["c"],
            "drop_bound": None if op == REFERENCE_OP or not pairs else s["bound"],
            "chunk_share": 1.0 if op == REFERENCE_OP else s["chunk_share"],
            "tokens_computed_mean": s["computed"], "context_tokens_mean": s["context"],
            "ms_per_request": s["ms"], "ms_recompute": s["ref_ms"],
        }
    counts = {k: len({r["case"] for rs in rows.values() for r in rs if r.get("kind", "compose") == k})
              for k in sorted(kinds)}
    return {"meta": {**meta, "cases": counts, "target": dict(TARGET)}, "ops": ops}


def method_name(sweep_op: str) -> str | None:
    """The ``<compile> | <method>[ r]`` name of a ``runner.compose_ops`` operation (compiled after
    BOS: "bos"); None for ops this table does not carry (naive splice)."""
    from kvruntime.fidelity.report import params_of as sweep_params
    if sweep_op == REFERENCE_OP:
        return REFERENCE_OP
    try:
        p = sweep_params(sweep_op)
    except ValueError:
        return None
    if p["recompute_ratio"]:
        return f"bos | {p.get('probe', 'kv1')} {p['recompute_ratio']:.0%}" if p["seam_tokens"] == 1 else None
    return f"bos | seam {p['seam_tokens']}"


def as_method_rows(*row_sets: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """``run_compose`` rows of ``compose_ops`` operations (several case sets) under method names."""
    out: dict[str, list[dict]] = {}
    for rows in row_sets:
        for op, rs in rows.items():
            name = method_name(op)
            if name is not None:
                out.setdefault(name, []).extend(rs)
    return out


def load_sources(from_rows=None, from_calibrate=None) -> dict[str, list[dict]]:
    """Per-op rows of ``--from-rows`` files and a ``--from-calibrate`` run log: the calibrate run's
    operations as it measured them, the rows files only for operations it did not measure."""
    rows = load_rows(from_rows) if from_rows else {}
    if not from_calibrate:
        return rows
    calibrated = calibrate_rows(from_calibrate)
    extra = {op: rs for op, rs in rows.items() if op not in calibrated}
    print(f"from the calibrate run: {len(calibrated)} ops; added from --from-rows: {sorted(extra) or 'none'}",
          file=sys.stderr)
    return {**calibrated, **extra}


def calibrate_rows(path: str | Path) -> dict[str, list[dict]]:
    """The compose and decision rows of a ``kvnotes calibrate`` run log (one JSON line per case:
    ``{"set", "case", "rows": {op: row}}``), under method names (:func:`as_method_rows`)."""
    sets: dict[str, dict[str, list[dict]]] = {"compose": {}, "decision": {}}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("set") in sets:
            for op, row in rec["rows"].items():
                sets[rec["set"]].setdefault(op, []).append(row)
    return as_method_rows(sets["compose"], sets["decision"])


def fill_chunk_counts(rows: dict[str, list[dict]], model: str) -> dict[str, list[dict]]:
    """Rows written before ``run_compose`` recorded chunk counts get them from the model's tokenizer
    (the chunk ids as ``run_compose`` encodes them; no weights loaded): ``chunk_tokens`` and
    ``chunk_recomputed`` = tokens computed minus the text around the chunks (always computed)."""
    if all("chunk_tokens" in r for rs in rows.values() for r in rs):
        return rows
    import transformers

    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.fidelity.cases import DECISION_CASES, load_compose_cases, load_decision_cases, load_passages
    from kvruntime.models import get_model_spec
    tok = transformers.AutoTokenizer.from_pretrained(ensure_checkpoint(get_model_spec(model)))
    dec, dec_passages = load_decision_cases(DECISION_CASES)
    cases = {c.id: c for c in load_compose_cases() + dec}
    passages = {**load_passages(), **dec_passages}
    size: dict[str, int] = {}
    for rs in rows.values():
        for r in rs:
            if "chunk_tokens" in r:
                continue
            if r["case"] not in size:
                size[r["case"]] = sum(len(tok(passages[p].strip() + "\n\n", add_special_tokens=False).input_ids)
                                      for p in cases[r["case"]].chunks)
            n = size[r["case"]]
            r["chunk_tokens"], r["chunk_recomputed"] = n, r["recomputed_tokens"] - (r["context_tokens"] - n)
            if not 0 <= r["chunk_recomputed"] <= n:
                raise ValueError(f"{r['op']} {r['case']}: {r['recomputed_tokens']} tokens computed do not fit "
                                 f"{n} chunk tokens of {r['context_tokens']} (rows of another model?)")
    return rows


def run_decisions(engine, n: int, ops: dict[str, dict]) -> dict[str, list[dict]]:
    """The first ``n`` yes/no decision cases (``cases.load_decision_cases``: the paper's E2, the
    memory placed late) under the ``compose_ops`` operations that have a method name."""
    from kvruntime.fidelity.cases import load_decision_cases, load_passages
    from kvruntime.fidelity.runner import run_compose
    if n <= 0:
        return {}
    dec, dec_passages = load_decision_cases(n)
    ops = {k: v for k, v in ops.items() if method_name(k) not in (None, REFERENCE_OP)}
    return run_compose(engine, dec, {**load_passages(), **dec_passages}, ops=ops)


def answers_from_runs(meta: dict, *row_sets: dict[str, list[dict]]) -> dict:
    """``compose_answers`` from ``run_compose`` rows of ``compose_ops`` operations (compose and
    decision cases measured apart)."""
    return answers_section(as_method_rows(*row_sets), meta)


def params_of(op: str) -> dict:
    """compose() parameters (+ ``compile``) of a sweep op from its name (``method_ops``' format)."""
    if op == REFERENCE_OP:
        return {"recompute": True}
    m = re.fullmatch(r"(\w+) \| (?:seam (\d+)|(\w[\w-]*) (\d+)%)", op)
    if not m:
        raise ValueError(f"not a sweep operation: {op!r}")
    if m.group(2):
        return {"compile": m.group(1), "rotate": True, "seam_tokens": int(m.group(2)), "recompute_ratio": 0.0,
                "probe": "kv1"}
    return {"compile": m.group(1), "rotate": True, "seam_tokens": 1, "recompute_ratio": int(m.group(4)) / 100,
            "probe": m.group(3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvruntime.fidelity.methods", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--answered", type=int, default=0, help="first N compose cases that carry an answer")
    ap.add_argument("--unanswered", type=int, default=0, help="first N compose cases without one")
    ap.add_argument("--decisions", type=int, default=0, help="first N yes/no decision cases")
    ap.add_argument("--decisions-from", type=int, default=0, help="skip the first N decision cases")
    ap.add_argument("--compile", nargs="+", default=["bos", "frame"])
    ap.add_argument("--methods", nargs="+", default=["seam1", "kv1", "qlast"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.05, 0.10])
    ap.add_argument("--only", nargs="+", help="measure only these op names of the grid (e.g. 'frame | kv1 10%%')")
    ap.add_argument("--rows-out")
    ap.add_argument("--from-rows", nargs="+")
    ap.add_argument("--from-calibrate", metavar="ROWS_JSONL",
                    help="a `kvnotes calibrate` run log (<run dir>/rows.jsonl): its compose and decision rows, "
                         "under method names; --from-rows then adds only operations it did not measure")
    ap.add_argument("--profile-out", nargs="+", metavar="JSON",
                    help="write the section compose_answers (intervals per op) into these profile files "
                         "(e.g. kvruntime/fidelity/tables/<model>.json; the other sections are kept)")
    args = ap.parse_args(argv)
    if args.from_rows or args.from_calibrate:
        for f in [*(args.from_rows or []), *([args.from_calibrate] if args.from_calibrate else [])]:
            if not Path(f).is_file():
                raise ValueError(f"--from-rows / --from-calibrate: {f} does not exist")
        rows = load_sources(args.from_rows, args.from_calibrate)
        if not rows:
            raise ValueError("--from-rows / --from-calibrate: the files hold no rows")
        if args.profile_out:
            fill_chunk_counts(rows, args.model)
    else:
        rows = _measure(args)
    if args.profile_out:
        section = answers_section(rows, {
            "model": args.model, "command": "python -m kvruntime.fidelity.methods " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(), "rows": list(args.from_rows or []),
            **({"calibrate_rows": args.from_calibrate} if args.from_calibrate else {})})
        for path in args.profile_out:
            write_section(Path(path), section, args.model)
    print(f"#### {args.model}: all cases\n\n{summary_table(rows)}\n")
    for kind in ("compose", "decision"):
        if any(r.get("kind", "compose") == kind for rs in rows.values() for r in rs):
            print(f"#### {args.model}: {kind} cases only\n\n{summary_table(rows, (kind,))}\n")
    return 0


def _measure(args) -> dict[str, list[dict]]:
    from collections import defaultdict

    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_compose_cases, load_decision_cases, load_passages
    from kvruntime.fidelity.runner import run_compose
    from kvruntime.ops.blend import probe_layer_of
    from kvruntime.ops.frame import compile_prefix

    engine = ReferenceEngine(args.model, dtype="float32", device=args.device, threads=args.threads)
    if not engine.rope.enabled:
        raise RuntimeError("RoPE self-test failed; cannot evaluate reposition")
    for c in args.compile:
        compile_prefix(engine, c)
    for m in args.methods:
        if not re.fullmatch(r"seam\d+", m):
            probe_layer_of(m, engine.num_layers)
    ops = method_ops(args.compile, args.methods, args.ratios)
    if args.only:
        unknown = set(args.only) - set(ops)
        if unknown:
            raise ValueError(f"--only names ops not in the grid: {sorted(unknown)}")
        ops = {k: v for k, v in ops.items() if k in args.only}
    every = load_compose_cases()
    cases = [c for c in every if c.answers][: args.answered] + [c for c in every if not c.answers][: args.unanswered]
    passages = load_passages()
    dec, dec_passages = load_decision_cases(args.decisions) if args.decisions else ([], {})
    dec = dec[args.decisions_from:]
    out = open(args.rows_out, "w") if args.rows_out else None
    rows: dict[str, list[dict]] = defaultdict(list)
    try:
        for subset, ps in ((cases, passages), (dec, {**passages, **dec_passages})):
            if subset:
                for op, rs in run_compose(engine, subset, ps, ops=ops, rows_out=out, share_probe=False).items():
                    rows[op] += rs
    finally:
        if out is not None:
            out.close()
    return dict(rows)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
