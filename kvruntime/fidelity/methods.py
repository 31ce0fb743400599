"""Compile prefix x token selection sweep (issue 24), with intervals and the answer-based target.

    python -m kvruntime.fidelity.methods --model smollm2-135m --threads 1 --answered 24 \
        --decisions 40 --compile bos frame --methods seam1 kv1 qlast qlate --ratios 0.05 0.1 \
        --rows-out /tmp/rows.jsonl
    python -m kvruntime.fidelity.methods --model smollm2-135m --from-rows /tmp/rows.jsonl

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
import math
import re
import sys

from kvruntime.fidelity.report import load_rows, wilson
from kvruntime.fidelity.runner import REFERENCE_OP

TARGET = dict(drop_bound=0.02, decision=0.98, top1=0.95, max_ratio=0.10)


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


def newcombe_paired_upper(a: int, b: int, c: int, d: int, z: float = 1.645) -> float:
    """One-sided upper bound of p1 - p2 for paired binary outcomes (Newcombe 1998, method 10):
    a = both right, b = only 1 right, c = only 2 right, d = both wrong. Here 1 = recompute and
    2 = the operation, so the bound is how much accuracy the operation may lose."""
    n = a + b + c + d
    if n == 0:
        return math.nan
    p1, p2 = (a + b) / n, (a + c) / n
    l2, u2 = wilson(a + c, n, z)
    l1, u1 = wilson(a + b, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den else 0.0
    eps = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return (p1 - p2) + eps


def _pct(k, n):
    if not n:
        return "n/a"
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {k / n:.0%} ({lo:.0%}-{hi:.0%})"


def summary_table(rows: dict[str, list[dict]], kinds=("compose", "decision")) -> str:
    ref = {r["case"]: r for r in rows.get(REFERENCE_OP, [])}
    sets = [{r["case"] for r in rs} for op, rs in rows.items() if op != REFERENCE_OP]
    common = set.intersection(*sets) if sets else set()     # cases every operation finished
    lines = ["| operation | n | KL mean | top-1 agree (95% CI) | greedy-16 exact (95% CI) | answers right (recompute) | "
             "lost / gained | accuracy drop, 1-sided 95% bound | decision agree (95% CI) | "
             "tokens computed / context | ms / request, median (recompute) | meets target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for op in rows:
        rs = [r for r in rows[op] if r.get("kind", "compose") in kinds and r["case"] in common]
        n = len(rs)
        if not n:
            continue
        top1, exact = round(sum(r["top1"] for r in rs)), round(sum(r["greedy_exact"] for r in rs))
        pairs = [(ref[r["case"]]["answer_ok"], r["answer_ok"]) for r in rs
                 if r.get("answer_ok") is not None and r["case"] in ref]
        a = sum(1 for x, y in pairs if x and y)
        b = sum(1 for x, y in pairs if x and not y)
        c = sum(1 for x, y in pairs if y and not x)
        d = len(pairs) - a - b - c
        bound = newcombe_paired_upper(a, b, c, d) if pairs else math.nan
        dec = [r["decision_agree"] for r in rs if "decision_agree" in r]
        k_dec = round(sum(dec))
        chunk = [(r["recomputed_tokens"], r["context_tokens"]) for r in rs]
        secs = [r["seconds"] for r in rs if "seconds" in r]
        ref_secs = [ref[r["case"]]["seconds"] for r in rs if r["case"] in ref and "seconds" in ref[r["case"]]]
        ratio = _ratio_of(op)
        ok = (op != REFERENCE_OP and ratio is not None and ratio <= TARGET["max_ratio"] and top1 / n >= TARGET["top1"]
              and (not pairs or bound <= TARGET["drop_bound"]) and (not dec or k_dec / len(dec) >= TARGET["decision"]))
        lines.append(
            f"| {op} | {n} | {sum(r['kl'] for r in rs) / n:.3f} | {_pct(top1, n)} | {_pct(exact, n)} | "
            + (f"{a + c}/{len(pairs)} ({a + b}/{len(pairs)}) | {b} / {c} | "
               + ("- | " if op == REFERENCE_OP else f"{bound:+.1%} | ") if pairs else "n/a | n/a | n/a | ")
            + f"{_pct(k_dec, len(dec)) if dec else 'n/a'} | "
            + f"{sum(x for x, _ in chunk) / n:.0f} / {sum(y for _, y in chunk) / n:.0f} | "
            + (f"{1000 * _median(secs):.0f} ({1000 * _median(ref_secs):.0f})" if secs and ref_secs else "n/a")
            + f" | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def _median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def _ratio_of(op: str) -> float | None:
    if op == REFERENCE_OP:
        return None
    m = re.search(r" (\d+)%$", op)
    return int(m.group(1)) / 100 if m else 0.0


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
    args = ap.parse_args(argv)
    if args.from_rows:
        rows = load_rows(args.from_rows)
    else:
        rows = _measure(args)
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
