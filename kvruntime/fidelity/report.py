"""Summaries (JSON, read by the planner) and markdown tables of a fidelity run."""
from __future__ import annotations

import json
import math
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
           f"Command: `{m['command']}` — {m['date']}, {m['machine']}, {m['seconds']:.0f} s.", ""]
    sweep = summary.get("compose_sweep")
    if sweep:
        sm = sweep["meta"]
        out += ["#### Compose with selective recompute: r sweep on cases with expected answers",
                f"Command: `{sm['command']}` — {sm['date']}, {sm['machine']}, {sm['seconds']:.0f} s, "
                f"{sm['cases']['compose']} compose cases.", "", table(sweep["ops"]), ""]
    for key, title in SECTIONS:
        if summary.get(key):
            out += [f"#### {title}", "", table(summary[key]), ""]
    return "\n".join(out)
