"""The statistics of a compose sweep (``kvruntime.fidelity.methods``): per operation, agreement with
recompute and answer accuracy paired with recompute's, with their intervals (Wilson; Newcombe's
paired interval for the accuracy drop), whether it meets ``balanced``'s answer target, and the
printed table."""
from __future__ import annotations

import math
import re

from kvruntime.config import BALANCED_ANSWER_TARGET
from kvruntime.fidelity.report import wilson
from kvruntime.fidelity.runner import REFERENCE_OP

TARGET = dict(BALANCED_ANSWER_TARGET)   # drop_bound, decision, top1, max_ratio (the config's defaults)


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


def common_cases(rows: dict[str, list[dict]]) -> set[str]:
    """Cases every operation finished (the reference row does not narrow them)."""
    sets = [{r["case"] for r in rs} for op, rs in rows.items() if op != REFERENCE_OP]
    return set.intersection(*sets) if sets else set()


def op_stats(op: str, rows: dict[str, list[dict]], common: set[str] | None, kinds=("compose", "decision")) -> dict | None:
    """One operation's counts on ``common`` cases (None: every case it measured) of ``kinds``,
    paired with recompute's rows."""
    ref = {r["case"]: r for r in rows.get(REFERENCE_OP, [])}
    rs = [r for r in rows[op] if r.get("kind", "compose") in kinds and (common is None or r["case"] in common)]
    if not rs:
        return None
    pairs = [(ref[r["case"]]["answer_ok"], r["answer_ok"]) for r in rs
             if r.get("answer_ok") is not None and r["case"] in ref and ref[r["case"]].get("answer_ok") is not None]
    a = sum(1 for x, y in pairs if x and y)
    b = sum(1 for x, y in pairs if x and not y)
    c = sum(1 for x, y in pairs if y and not x)
    dec = [r["decision_agree"] for r in rs if "decision_agree" in r]
    chunk = [(r["chunk_recomputed"], r["chunk_tokens"]) for r in rs if "chunk_tokens" in r]
    secs = [r["seconds"] for r in rs if "seconds" in r]
    ref_secs = [ref[r["case"]]["seconds"] for r in rs if r["case"] in ref and "seconds" in ref[r["case"]]]
    return dict(n=len(rs), kl=sum(r["kl"] for r in rs) / len(rs), top1=round(sum(r["top1"] for r in rs)),
                exact=round(sum(r["greedy_exact"] for r in rs)), pairs=len(pairs), a=a, b=b, c=c,
                d=len(pairs) - a - b - c,
                bound=newcombe_paired_upper(a, b, c, len(pairs) - a - b - c) if pairs else math.nan,
                dec_n=len(dec), dec_k=round(sum(dec)),
                computed=sum(r["recomputed_tokens"] for r in rs) / len(rs),
                context=sum(r["context_tokens"] for r in rs) / len(rs),
                chunk_share=(sum(x for x, _ in chunk) / sum(y for _, y in chunk)
                             if len(chunk) == len(rs) and sum(y for _, y in chunk) else None),
                ms=1000 * _median(secs) if secs else None, ref_ms=1000 * _median(ref_secs) if ref_secs else None)


def meets(op: str, s: dict, target: dict = TARGET) -> bool:
    """The answer-based target on one op's stats (the planner applies the same rule to the
    profile, with minimum case counts: ``cluster.control.planner.FidelityTarget``)."""
    ratio = _ratio_of(op)
    return (op != REFERENCE_OP and ratio is not None and ratio <= target["max_ratio"]
            and s["top1"] / s["n"] >= target["top1"]
            and (not s["pairs"] or s["bound"] <= target["drop_bound"])
            and (not s["dec_n"] or s["dec_k"] / s["dec_n"] >= target["decision"]))


def summary_table(rows: dict[str, list[dict]], kinds=("compose", "decision")) -> str:
    common = common_cases(rows)
    lines = ["| operation | n | KL mean | top-1 agree (95% CI) | greedy-16 exact (95% CI) | answers right (recompute) | "
             "lost / gained | accuracy drop, 1-sided 95% bound | decision agree (95% CI) | "
             "tokens computed / context | ms / request, median (recompute) | meets target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for op in rows:
        s = op_stats(op, rows, common, kinds)
        if s is None:
            continue
        n, a, b, c, pairs = s["n"], s["a"], s["b"], s["c"], s["pairs"]
        lines.append(
            f"| {op} | {n} | {s['kl']:.3f} | {_pct(s['top1'], n)} | {_pct(s['exact'], n)} | "
            + (f"{a + c}/{pairs} ({a + b}/{pairs}) | {b} / {c} | "
               + ("- | " if op == REFERENCE_OP else f"{s['bound']:+.1%} | ") if pairs else "n/a | n/a | n/a | ")
            + f"{_pct(s['dec_k'], s['dec_n']) if s['dec_n'] else 'n/a'} | "
            + f"{s['computed']:.0f} / {s['context']:.0f} | "
            + (f"{s['ms']:.0f} ({s['ref_ms']:.0f})" if s["ms"] is not None and s["ref_ms"] is not None else "n/a")
            + f" | {'yes' if meets(op, s) else 'no'} |")
    return "\n".join(lines)


def _interval(k: int, n: int) -> list[float] | None:
    return list(wilson(k, n)) if n else None


def _median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def _ratio_of(op: str) -> float | None:
    if op == REFERENCE_OP:
        return None
    m = re.search(r" (\d+)%$", op)
    return int(m.group(1)) / 100 if m else 0.0
