"""Which model answers better: recompute's answer accuracy and prefill time per shipped model.

    nice -n 10 python -m kvruntime.fidelity.model_choice --models smollm2-135m gemma3-270m \
        --compose 10 --decisions 10 --sessions 10 --threads 1

Every case is a full recompute (no composition: this compares the models, not the operations):
``compose`` the first N compose cases that carry an answer (greedy 16 tokens contain one of the
accepted answers, ``metrics.answer_correct``), ``decisions`` the first N yes/no decision cases
(the yes/no read from the next-token logits, ``runner.decision_of``), ``sessions`` the first N
``lookup`` edit cases, asked after the field changed (the answer contains the new value). The
prefill time of the whole context (the TTFT of an uncached request, in process, without the
cluster's transfer and queueing) is reported as the forward's CPU time (with ``--threads 1`` the
wall time it takes on an idle core; wall times on a loaded machine are reported beside it), median
per case and per 100 tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def measure(model: str, n_compose: int, n_decisions: int, n_sessions: int, threads: int | None) -> dict:
    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_compose_cases, load_decision_cases, load_edit_cases, load_passages, \
        split_template
    from kvruntime.fidelity.metrics import answer_correct
    from kvruntime.fidelity.runner import decision_of
    from kvruntime.ops.frame import chat_frame
    from kvruntime.ops import recompute

    engine = ReferenceEngine(model, threads=threads)
    pre, suffix = chat_frame(engine), engine.spec.chat_user_suffix
    passages = load_passages()
    dec, dec_passages = load_decision_cases(n_decisions) if n_decisions else ([], {})
    passages = {**passages, **dec_passages}
    jobs = []
    for c in [c for c in load_compose_cases() if c.answers][:n_compose] + dec:
        ids = pre + engine.encode(c.prelude) if c.prelude else list(pre)
        ids += [t for p in c.chunks for t in engine.encode(passages[p].strip() + "\n\n")]
        jobs.append((c.kind, c.id, ids + engine.encode(c.question + suffix), c.answers))
    for c in [c for c in load_edit_cases() if c.kind == "lookup"][:n_sessions]:
        before, after = split_template(c)
        ids = pre + engine.encode(before) + engine.encode(c.new) + engine.encode(after)
        jobs.append(("session", c.id, ids + engine.encode(c.question + suffix), (c.new,)))
    rows = []
    for kind, cid, ids, answers in jobs:
        t, c = time.perf_counter(), time.process_time()
        out = recompute(engine, ids)
        secs, cpu = time.perf_counter() - t, time.process_time() - c
        if kind == "decision":
            text = decision_of(engine, out.logits)
            ok = text == answers[0]
        else:
            text = engine.decode(engine.greedy(out.kv, out.logits, 16, stop_at_eos=True))
            ok = bool(answer_correct(text, answers))
        rows.append(dict(model=model, kind=kind, case=cid, tokens=len(ids), prefill_s=secs, prefill_cpu_s=cpu,
                         ok=ok, text=text))
        print(json.dumps(rows[-1]), flush=True)
    return summarize(model, rows)


def summarize(model: str, rows: list[dict]) -> dict:
    from kvruntime.fidelity.report import wilson
    out = {"model": model}
    for kind in ("compose", "decision", "session"):
        rs = [r for r in rows if r["kind"] == kind]
        k = sum(r["ok"] for r in rs)
        out[kind] = {"n": len(rs), "k": k, "ci": list(wilson(k, len(rs))) if rs else None}
    k, n = sum(r["ok"] for r in rows), len(rows)
    secs = sorted(r["prefill_cpu_s"] for r in rows)
    out["all"] = {"n": n, "k": k, "ci": list(wilson(k, n)) if n else None}
    out["prefill_ms_median"] = 1000 * secs[len(secs) // 2] if secs else None
    out["prefill_ms_per_100_tokens"] = (100_000 * sum(secs) / sum(r["tokens"] for r in rows)) if rows else None
    out["prefill_wall_ms_median"] = 1000 * sorted(r["prefill_s"] for r in rows)[len(rows) // 2] if rows else None
    return out


def table(results: list[dict]) -> str:
    def cell(s):
        return f"{s['k']}/{s['n']} [{s['ci'][0]:.0%}-{s['ci'][1]:.0%}]" if s and s["n"] else "n/a"
    lines = ["| model | compose answers right | decisions right | session (edited field) answers right | all | "
             "prefill CPU ms, median per case (wall, loaded) | prefill CPU ms per 100 tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {cell(r['compose'])} | {cell(r['decision'])} | {cell(r['session'])} | "
                     f"{cell(r['all'])} | {r['prefill_ms_median']:.0f} ({r['prefill_wall_ms_median']:.0f}) | "
                     f"{r['prefill_ms_per_100_tokens']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvruntime.fidelity.model_choice", description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--compose", type=int, default=10)
    ap.add_argument("--decisions", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    results = [measure(m, args.compose, args.decisions, args.sessions, args.threads) for m in args.models]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
