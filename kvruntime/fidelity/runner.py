"""Runs every KV operation on the shipped cases and compares it with full recompute."""
from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from typing import Callable

import torch

from kvruntime.fidelity.cases import ComposeCase, EditCase, split_template
from kvruntime.fidelity.metrics import answer_correct, compare
from kvruntime.kv import KVCache
from kvruntime.ops import (ChunkSegment, TextSegment, compose, edit_in_place, erratum, precompile_chunk,
                           recompute)
from kvruntime.ops.frame import chat_frame

COMPOSE_OPS = {  # name -> compose() keyword arguments
    "naive splice (no re-rotation)": dict(rotate=False, seam_tokens=0),
    "reposition": dict(rotate=True, seam_tokens=0),
    "reposition + seam 1": dict(rotate=True, seam_tokens=1),
    "reposition + seam 4": dict(rotate=True, seam_tokens=4),
}
REFERENCE_OP = "full recompute (reference)"
BLEND_RATIOS = (0.05, 0.10, 0.15, 0.25, 0.50)   # the r sweep (r=0 is "reposition + seam 1")


DEFAULT_PROBE = "kv1"      # ops.compose's default, what prefill executors run


def blend_op(ratio: float, seam: int = 1, probe: str = DEFAULT_PROBE) -> str:
    return f"reposition + seam {seam} + recompute {ratio:.0%}" + ("" if probe == DEFAULT_PROBE else f" ({probe})")


def compose_ops(ratios=(), probes=(DEFAULT_PROBE,), seams=(1,)) -> dict[str, dict]:
    """The compose operations measured: the fixed ones plus one selective recompute per ratio,
    probe and seam count."""
    ops = dict(COMPOSE_OPS)
    for seam in seams:
        for probe in probes:
            for r in ratios:
                ops[blend_op(r, seam, probe)] = dict(rotate=True, seam_tokens=seam, recompute_ratio=r, probe=probe)
    return ops


EDIT_OPS = ("stale (no fix)", "field only", "field + top-16", "field + top-25%",
            "erratum: correction", "erratum: update", "erratum: restate old")
COT_OPS = ("stale (no fix)", "field only", "field + top-16", "erratum: correction")
COT_SUFFIX = " Think step by step, then give the answer."

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _finish(engine, kv: KVCache, question_ids: list[int]):
    """The question after ``kv``, through the one builder (kvruntime.ops.build): ``kv`` copied
    once into a buffer with room for the question, whose K/V are written in place."""
    from kvruntime.ops.build import Builder
    b = Builder(engine, kv.num_tokens + len(question_ids))
    b.append(kv)
    logits = b.compute(question_ids, int(kv.positions.max()) + 1, logits=True)
    return b.kv, logits


def decision_margin(engine, logits: torch.Tensor) -> float:
    """log P(yes) - log P(no) at the next token, each word's probability summed over the first
    tokens of "yes"/"Yes"/" yes"/" Yes" (and the same for "no")."""
    def ids(word):
        return sorted({engine.encode(v)[0] for v in (word, word.capitalize(), " " + word, " " + word.capitalize())})
    lp = torch.log_softmax(logits.double(), -1)
    return float(torch.logsumexp(lp[ids("yes")], 0) - torch.logsumexp(lp[ids("no")], 0))


def decision_of(engine, logits: torch.Tensor) -> str:
    """A yes/no decision read from next-token logits: "yes" if :func:`decision_margin` > 0. (Small
    models often start "The assistant will ..." greedily; the yes/no contest is always defined.)"""
    return "yes" if decision_margin(engine, logits) > 0 else "no"


def run_compose(engine, cases: list[ComposeCase], passages: dict[str, str], *, greedy_n: int = 16,
                progress: Progress = _stderr, ops: dict[str, dict] | None = None,
                rows_out=None, share_probe: bool = True, on_case=None) -> dict[str, list[dict]]:
    """Per op, one row per case. Chunks are precompiled once per passage (and compile prefix:
    an op's ``compile`` keyword, see ``kvruntime.ops.frame.compile_prefix``) and reused across
    cases, as the tier would. Cases with expected answers also get ``answer_ok`` per op and a
    ``REFERENCE_OP`` row (full recompute judged against the answer); decision cases (yes/no) get
    ``decision`` and ``decision_agree`` (same yes/no as recompute). Every row also carries the
    recompute's top-1/top-2 logit margin (``oracle_margin``: a near-tie flips easily) and the
    op's wall time (``seconds``: compose + question, not the offline chunk compile). With
    ``rows_out`` (a text file) every row is also written as one JSON line as it is measured.
    ``share_probe=False`` runs each ratio's probe anew (honest per-op wall time). ``on_case(case,
    {op: row})`` is called after each case (``kvnotes calibrate`` appends it to its run log)."""
    from kvruntime.ops.frame import compile_prefix
    ops = COMPOSE_OPS if ops is None else ops
    pre, suffix = chat_frame(engine), engine.spec.chat_user_suffix
    chunk_ids = {pid: engine.encode(passages[pid].strip() + "\n\n") for c in cases for pid in c.chunks}
    chunk_kv: dict[tuple[str, str], KVCache] = {}
    prefixes: dict[str, list[int] | None] = {}
    rows: dict[str, list[dict]] = defaultdict(list)
    t0 = time.monotonic()
    for i, case in enumerate(cases, 1):
        q = engine.encode(case.question + suffix)
        head = pre + (engine.encode(case.prelude) if case.prelude else [])
        ids = head + [t for pid in case.chunks for t in chunk_ids[pid]] + q
        t = time.perf_counter()
        oracle = recompute(engine, ids)
        oracle_s = time.perf_counter() - t
        oracle_greedy = engine.greedy(oracle.kv, oracle.logits, greedy_n, stop_at_eos=True)
        top2 = torch.topk(oracle.logits.float(), 2).values
        margin = float(top2[0] - top2[1])
        oracle_dec = decision_of(engine, oracle.logits) if case.kind == "decision" else None
        dec_margin = decision_margin(engine, oracle.logits) if case.kind == "decision" else None

        def segments(mode: str):
            if mode not in prefixes:
                prefixes[mode] = compile_prefix(engine, mode)
            prefix = prefixes[mode]
            for pid in case.chunks:
                if (pid, mode) not in chunk_kv:
                    chunk_kv[pid, mode] = precompile_chunk(engine, chunk_ids[pid], prefix)
            tag = None if mode == "bos" else tuple(prefix)     # "bos": today's path, no exact-reuse check
            return ([TextSegment(head)] + [ChunkSegment(chunk_kv[p, mode], tag) for p in case.chunks]
                    + [TextSegment(q)])

        def judged(g, logits):
            if case.kind == "decision":
                dec = decision_of(engine, logits)
                return dict(answer_ok=float(dec == case.answers[0]), decision=dec,
                            decision_agree=float(dec == oracle_dec), oracle_decision_margin=dec_margin)
            return dict(answer_ok=answer_correct(engine.decode(g), case.answers) if case.answers else None)
        n_chunk = sum(len(chunk_ids[pid]) for pid in case.chunks)
        common = dict(case=case.id, kind=case.kind, context_tokens=len(ids), oracle_margin=margin, chunk_tokens=n_chunk)
        if case.answers:
            row = compare(oracle.logits, oracle_greedy, oracle.logits, oracle_greedy)
            row.update(common, recomputed_tokens=len(ids), chunk_recomputed=n_chunk, seconds=oracle_s,
                       **judged(oracle_greedy, oracle.logits))
            rows[REFERENCE_OP].append(row)
            _dump(rows_out, REFERENCE_OP, row, oracle_greedy, engine)
        probe_cache: dict = {}                      # one probe per context, shared by every ratio
        for name, kw in ops.items():
            kw = dict(kw)
            segs = segments(kw.pop("compile", "bos"))
            extra = {"probe_cache": probe_cache} if kw.get("recompute_ratio") and share_probe else {}
            t = time.perf_counter()
            res = compose(engine, segs, **kw, **extra)
            secs = time.perf_counter() - t
            g = engine.greedy(res.kv, res.logits, greedy_n, stop_at_eos=True)
            row = compare(oracle.logits, oracle_greedy, res.logits, g)
            row.update(common, recomputed_tokens=res.computed_tokens, probed_tokens=res.probed_tokens,
                       chunk_recomputed=res.computed_tokens - (len(ids) - n_chunk),   # text is always computed
                       seconds=secs, **judged(g, res.logits))
            rows[name].append(row)
            _dump(rows_out, name, row, g, engine)
        if on_case is not None:
            on_case(case, {op: rs[-1] for op, rs in rows.items() if rs and rs[-1]["case"] == case.id})
        progress(f"  compose [{i}/{len(cases)}] {case.id}: {len(ids)} tokens, "
                 f"{time.monotonic() - t0:.0f} s elapsed")
    return dict(rows)


def _dump(out, op: str, row: dict, greedy: list[int], engine) -> None:
    if out is not None:
        import json
        out.write(json.dumps({"op": op, **row, "greedy_text": engine.decode(greedy)}) + "\n")
        out.flush()


ANSWER_EDIT_OPS = ("stale (no fix)", "field + top-16", "erratum: correction")   # what the planner plans (+ the baseline)


def edit_answers_of(case: EditCase) -> tuple[tuple[str, ...], bool]:
    """How an edit case's answers are judged: a lookup's answer is the new value (accepted when
    the greedy answer names it); a derived case asks yes or no (judged by its decision, paired
    with recompute's). Returns (accepted answers, is a yes/no decision)."""
    yes_no = case.kind == "derived" and "yes or no" in case.question.lower()
    return ((case.new,) if case.kind == "lookup" else ()), yes_no


def run_edit(engine, cases: list[EditCase], *, cot: bool = False, greedy_n: int = 16,
             progress: Progress = _stderr, on_case=None, ops=None,
             reference: bool = False) -> tuple[dict[str, list[dict]], dict[str, bool]]:
    """Per op, one row per case, plus which cases are *informative* (the oracle's greedy
    answer differs from the stale context's: the edit changes what the model says).
    ``on_case(case, {op: row}, informative)`` is called after each case. ``ops``: the edit
    operations (default every one in ``EDIT_OPS``; "stale (no fix)" is always measured, the
    informative flag needs it). Every row is judged (:func:`edit_answers_of`): ``answer_ok`` on
    lookups, ``decision`` / ``decision_agree`` on yes/no cases; ``reference=True`` adds a
    ``REFERENCE_OP`` row (recompute judged the same way, its wall time), which the answer-level
    edit rows pair with (``kvruntime.fidelity.edit_answers``)."""
    pre, suffix = chat_frame(engine), engine.spec.chat_user_suffix
    ops = COT_OPS if cot else tuple(ops or EDIT_OPS)
    unknown = set(ops) - set(EDIT_OPS)
    if unknown:
        raise ValueError(f"unknown edit operations {sorted(unknown)}; known: {', '.join(EDIT_OPS)}")
    ops = ("stale (no fix)",) + tuple(o for o in ops if o != "stale (no fix)")
    rows: dict[str, list[dict]] = defaultdict(list)
    informative: dict[str, bool] = {}
    t0 = time.monotonic()
    for i, case in enumerate(cases, 1):
        before, after = split_template(case)
        b_ids, a_ids = pre + engine.encode(before), engine.encode(after)
        old_ids, new_ids = engine.encode(case.old), engine.encode(case.new)
        q = engine.encode(case.question + (COT_SUFFIX if cot else "") + suffix)
        t = time.perf_counter()
        oracle = recompute(engine, b_ids + new_ids + a_ids + q)
        oracle_s = time.perf_counter() - t
        oracle_greedy = engine.greedy(oracle.kv, oracle.logits, greedy_n, stop_at_eos=True)
        judge = _edit_judge(engine, case, oracle.logits)
        cached = recompute(engine, b_ids + old_ids + a_ids, logits=False).kv   # the old notes
        span = (len(b_ids), len(b_ids) + len(old_ids))
        n_ctx = len(b_ids) + len(new_ids) + len(a_ids) + len(q)
        common = dict(case=case.id, kind=case.kind, category=case.category)
        if reference:
            row = compare(oracle.logits, oracle_greedy, oracle.logits, oracle_greedy)
            row.update(common, recomputed_tokens=n_ctx, context_tokens=n_ctx, seconds=oracle_s,
                       **judge(oracle_greedy, oracle.logits))
            rows[REFERENCE_OP].append(row)
        for name in ops:
            t = time.perf_counter()             # the fix and the question: the operation's cost
            kv, recomputed, extra = _edit_op(engine, name, case, cached, span, new_ids, len(a_ids))
            full, logits = _finish(engine, kv, q)
            secs = time.perf_counter() - t
            g = engine.greedy(full, logits, greedy_n, stop_at_eos=True)
            row = compare(oracle.logits, oracle_greedy, logits, g)
            row.update(common, recomputed_tokens=recomputed + len(q), context_tokens=n_ctx + extra, seconds=secs,
                       **judge(g, logits))
            rows[name].append(row)
        informative[case.id] = rows["stale (no fix)"][-1]["greedy_exact"] < 1.0
        if on_case is not None:
            on_case(case, {op: rs[-1] for op, rs in rows.items() if rs and rs[-1]["case"] == case.id},
                    informative[case.id])
        progress(f"  edit{' (CoT)' if cot else ''} [{i}/{len(cases)}] {case.id}: {n_ctx} tokens, "
                 f"{time.monotonic() - t0:.0f} s elapsed")
    return dict(rows), informative


def _edit_op(engine, name: str, case: EditCase, cached: KVCache, span, new_ids, downstream: int):
    """One edit operation on the old notes: (KV, tokens computed, erratum tokens appended)."""
    if name == "stale (no fix)":
        return cached, 0, 0
    if name.startswith("field"):
        k = 0 if name == "field only" else 16 if name == "field + top-16" else math.ceil(0.25 * downstream)
        res = edit_in_place(engine, cached, span, new_ids, k)
        return res.kv, res.recomputed_tokens, 0
    style = {"erratum: correction": "correction", "erratum: update": "update",
             "erratum: restate old": "restate_old"}[name]
    res = erratum(engine, cached, case.label, case.old, case.new, style=style)
    return res.kv, len(res.token_ids), len(res.token_ids)


def _edit_judge(engine, case: EditCase, oracle_logits):
    """The judged fields of an edit case's row (see :func:`edit_answers_of`)."""
    answers, yes_no = edit_answers_of(case)
    oracle_dec = decision_of(engine, oracle_logits) if yes_no else None

    def judge(greedy, logits) -> dict:
        out = {}
        if answers:
            out["answer_ok"] = answer_correct(engine.decode(greedy), answers)
        if yes_no:
            dec = decision_of(engine, logits)
            out.update(decision=dec, decision_agree=float(dec == oracle_dec))
        return out
    return judge
