"""Summaries (JSON, read by the planner) and markdown tables of a fidelity run."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from kvruntime.fidelity.metrics import summarize

TABLES_DIR = Path(__file__).parent / "tables"   # shipped: the planner reads <model>.json


def build_summary(meta: dict, compose_rows: dict, edit_rows: dict, informative: dict,
                  cot_rows: dict, cot_informative: dict) -> dict:
    def informative_only(rows, flags):
        return [r for r in rows if flags.get(r["case"])]
    return {
        "meta": meta,
        "compose": with_params({op: summarize(rows) for op, rows in compose_rows.items()}),  # planner reads params
        "edit": {op: summarize(rows) for op, rows in edit_rows.items()},
        "edit_informative": {op: summarize(informative_only(rows, informative)) for op, rows in edit_rows.items()},
        "edit_derived": {op: summarize([r for r in rows if r["kind"] == "derived"]) for op, rows in edit_rows.items()},
        "edit_cot": {op: summarize(rows) for op, rows in cot_rows.items()},
        "edit_cot_informative": {op: summarize(informative_only(rows, cot_informative)) for op, rows in cot_rows.items()},
    }


def build_sweep(meta: dict, compose_rows: dict, ops: dict[str, dict]) -> dict:
    """The compose r sweep (``--compose-only``): per op its summary and the compose() parameters
    that produced it (the planner reads ``params`` to know what a row's operation is)."""
    from kvruntime.fidelity.runner import REFERENCE_OP
    out = {}
    for op, rows in compose_rows.items():
        params = {"recompute": True} if op == REFERENCE_OP else _params(ops[op])
        out[op] = {**summarize(rows), "params": params}
    return {"meta": meta, "ops": out}


def _params(kw: dict) -> dict:
    out = {"rotate": kw.get("rotate", True), "seam_tokens": kw.get("seam_tokens", 1),
           "recompute_ratio": kw.get("recompute_ratio", 0.0)}
    if kw.get("recompute_ratio") and kw.get("probe", "kv1") != "kv1":
        out["probe"] = kw["probe"]            # absent: the default probe, what executors run
    return out


def with_params(section: dict) -> dict:
    """Attach compose() parameters to a compose section's rows by operation name."""
    from kvruntime.fidelity.runner import compose_ops
    known = compose_ops()
    return {op: ({**s, "params": _params(known[op])} if op in known else s) for op, s in section.items()}


def save_summary(model: str, summary: dict, tables_dir: Path = TABLES_DIR) -> Path:
    tables_dir.mkdir(parents=True, exist_ok=True)
    path = tables_dir / f"{model}.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=_nan_safe))
    return path


def load_summary(model: str, tables_dir: Path = TABLES_DIR) -> dict | None:
    path = tables_dir / f"{model}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _nan_safe(x):
    return None


def _f(x, fmt):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ordered(section: dict) -> list[tuple[str, dict]]:
    """Operations in the harness's own order (the saved JSON has its keys sorted)."""
    from kvruntime.fidelity.runner import BLEND_RATIOS, EDIT_OPS, REFERENCE_OP, compose_ops
    ratios = sorted(set(BLEND_RATIOS) | {0.2, 1.0})
    order = ([REFERENCE_OP] + list(compose_ops(ratios)) + list(compose_ops(ratios, ("kv4", "progressive"), (1, 4)))
             + list(EDIT_OPS))
    return sorted(section.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def table(section: dict) -> str:
    acc = any(s.get("answered") for s in section.values())
    lines = ["| operation | n | KL mean | KL p10 | KL p50 | KL p90 | logit cosine | top-1 agree | "
             "greedy exact | greedy common prefix | tokens recomputed / context |" + (" answer accuracy |" if acc else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if acc else "")]
    for op, s in _ordered(section):
        line = (f"| {op} | {s['n']} | {_f(s['kl_mean'], '.4f')} | {_f(s['kl_p10'], '.4f')} | "
                f"{_f(s['kl_p50'], '.4f')} | {_f(s['kl_p90'], '.4f')} | {_f(s['cosine_mean'], '.4f')} | "
                f"{_f(s['top1'], '.0%')} | {_f(s['greedy_exact'], '.0%')} | {_f(s['greedy_prefix'], '.0%')} | "
                f"{_f(s['recomputed_tokens_mean'], '.0f')} / {_f(s['context_tokens_mean'], '.0f')} |")
        if acc:
            line += (f" {round(s['accuracy'] * s['answered'])}/{s['answered']} ({_f(s['accuracy'], '.0%')}) |"
                     if s.get("answered") else " n/a |")
        lines.append(line)
    return "\n".join(lines)


SECTIONS = [
    ("compose", "Compose: 2-4 precompiled chunks + question, vs full recompute"),
    ("edit", "Field edit: all cases, vs full recompute of the edited context"),
    ("edit_informative", "Field edit: informative cases only (the edit changes the recomputed greedy answer)"),
    ("edit_derived", "Field edit: derived-decision questions only"),
    ("edit_cot", "Field edit with chain of thought (greedy-32): all cases"),
    ("edit_cot_informative", "Field edit with chain of thought (greedy-32): informative cases only"),
]


def render_markdown(summary: dict) -> str:
    m = summary["meta"]
    out = [f"### {m['model']} ({m['dtype']}, {m['device']})",
           f"Command: `{m['command']}` — {m['date']}, {m['machine']}, {_f(m.get('seconds'), '.0f')} s.", ""]
    sweep = summary.get("compose_sweep")
    if sweep:
        sm = sweep["meta"]
        out += ["#### Compose with selective recompute: r sweep (answer accuracy over the cases that carry one)",
                f"Command: `{sm['command']}` — {sm['date']}, {sm['machine']}, {_f(sm.get('seconds'), '.0f')} s, "
                f"{sm['cases']['compose']} compose cases.", "", table(sweep["ops"]), ""]
    for key, title in SECTIONS:
        if summary.get(key):
            out += [f"#### {title}", "", table(summary[key]), ""]
    return "\n".join(out)


_OP = re.compile(r"reposition \+ seam (\d+)(?: \+ recompute (\d+)%(?: \((\w+)\))?)?$")


def params_of(op: str) -> dict:
    """compose() parameters of a sweep operation from its name (``blend_op``'s format)."""
    from kvruntime.fidelity.runner import REFERENCE_OP
    if op == REFERENCE_OP:
        return {"recompute": True}
    m = _OP.match(op)
    if not m:
        raise ValueError(f"not a sweep operation: {op!r}")
    kw = {"rotate": True, "seam_tokens": int(m.group(1)), "recompute_ratio": int(m.group(2) or 0) / 100}
    if m.group(3):
        kw["probe"] = m.group(3)
    return _params(kw)


def load_rows(paths) -> dict[str, list[dict]]:
    """Per-case rows (``--rows-out`` files) by operation; a case measured twice keeps its last row."""
    by_op: dict[str, dict[str, dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                by_op.setdefault(r["op"], {})[r["case"]] = r
    return {op: list(rows.values()) for op, rows in by_op.items()}


def sweep_from_rows(meta: dict, rows: dict[str, list[dict]]) -> dict:
    """A ``compose_sweep`` section from per-case rows; only cases every operation measured count
    (the reference row exists for cases with an expected answer only, so it does not narrow them)."""
    from kvruntime.fidelity.runner import REFERENCE_OP
    sets = [{r["case"] for r in rs} for op, rs in rows.items() if op != REFERENCE_OP]
    common = set.intersection(*sets) if sets else set()
    out = {}
    for op, rs in rows.items():
        out[op] = {**summarize([r for r in rs if r["case"] in common]), "params": params_of(op)}
    return {"meta": {**meta, "cases": {"compose": len(common)}}, "ops": out}


def flips_table(rows: dict[str, list[dict]]) -> str:
    """Cases whose first token differs from recompute's under some operation, with recompute's
    top-1/top-2 logit margin (a near-tie flips under any perturbation) and the ops that flip."""
    from kvruntime.fidelity.runner import REFERENCE_OP
    ops = [op for op, _ in _ordered({op: {} for op in rows}) if op != REFERENCE_OP]
    margin, flipped = {}, {}
    for op in ops:
        for r in rows[op]:
            margin[r["case"]] = r.get("oracle_margin")
            if r["top1"] < 1.0:
                flipped.setdefault(r["case"], []).append(op)
    margins = sorted(m for m in margin.values() if m is not None)
    lines = [f"Recompute's top-1/top-2 logit margin over all {len(margins)} cases: median "
             f"{_f(margins[len(margins) // 2] if margins else None, '.2f')}.", "",
             "| case | recompute margin (logits) | ops whose first token differs |", "|---|---|---|"]
    for case in sorted(flipped, key=lambda c: margin.get(c) or 0.0):
        names = flipped[case]
        lines.append(f"| {case} | {_f(margin.get(case), '.3f')} | "
                     f"{len(names)}/{len(ops)}: {', '.join(n.replace('reposition + ', '') for n in names)} |")
    return "\n".join(lines)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (how far n cases pin an agreement rate)."""
    if n <= 0:
        return math.nan, math.nan
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def paired_table(rows: dict[str, list[dict]], noise: float = 1e-3) -> str:
    """Per operation, on the cases every operation measured: top-1 and greedy-16 exact agreement
    with their 95% intervals, the top-1 flips whose recompute margin is below ``noise`` logits
    (could be fp noise) or below 0.1, and answer accuracy paired with recompute's on the same
    cases (answers lost: recompute right, the op wrong; gained: the reverse)."""
    from kvruntime.fidelity.runner import REFERENCE_OP
    sets = [{r["case"] for r in rs} for op, rs in rows.items() if op != REFERENCE_OP]
    common = set.intersection(*sets) if sets else set()
    ref = {r["case"]: r.get("answer_ok") for r in rows.get(REFERENCE_OP, [])}
    lines = [f"| operation | n | top-1 agree (95% CI) | greedy-16 exact (95% CI) | flips | flips with recompute margin "
             f"< {noise:g} / < 0.1 logits | answers right (recompute) | lost / gained vs recompute |",
             "|---|---|---|---|---|---|---|---|"]
    for op, _ in _ordered({op: {} for op in rows}):
        if op == REFERENCE_OP:
            continue
        rs = [r for r in rows[op] if r["case"] in common]
        n = len(rs)
        top1, exact = round(sum(r["top1"] for r in rs)), round(sum(r["greedy_exact"] for r in rs))
        flips = [r for r in rs if r["top1"] < 1.0]
        tiny = sum(1 for r in flips if (r.get("oracle_margin") or 0.0) < noise)
        small = sum(1 for r in flips if (r.get("oracle_margin") or 0.0) < 0.1)
        judged = [(r["answer_ok"], ref.get(r["case"])) for r in rs if r.get("answer_ok") is not None
                  and ref.get(r["case"]) is not None]
        right, ref_right = sum(1 for a, _ in judged if a), sum(1 for _, b in judged if b)
        lost, gained = sum(1 for a, b in judged if b and not a), sum(1 for a, b in judged if a and not b)
        lo1, hi1 = wilson(top1, n)
        loe, hie = wilson(exact, n)
        lines.append(f"| {op} | {n} | {top1}/{n} = {_f(top1 / n if n else None, '.0%')} ({_f(lo1, '.0%')}-{_f(hi1, '.0%')}) | "
                     f"{exact}/{n} = {_f(exact / n if n else None, '.0%')} ({_f(loe, '.0%')}-{_f(hie, '.0%')}) | "
                     f"{len(flips)} | {tiny} / {small} | "
                     + (f"{right}/{len(judged)} ({ref_right}/{len(judged)}) | {lost} / {gained} |" if judged else "n/a | n/a |"))
    return "\n".join(lines)

