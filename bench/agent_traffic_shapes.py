"""The prompts of ``bench.agent_traffic``: chat requests in the shapes agent frameworks and RAG apps
send, and the summary of what two systems did with them (pure: no model, no servers).

Every shape is a function ``(text, turns, rng, sizes) -> list of message lists``, one per turn, where
``text(offset, n_tokens)`` gives about ``n_tokens`` tokens of prose (never more) starting at word
``offset``; the same seed gives the same prompts, so both systems get identical requests.
"""
from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from typing import Callable

Text = Callable[[int, int], str]
Messages = list[dict]


@dataclass(frozen=True)
class Sizes:
    doc_tokens: int = 560          # each of the 8 documents (3 per request: ~1.7k tokens with the question)
    record_tokens: int = 1200      # the status record
    tools: int = 10                # functions in the shared tool catalogue
    tool_output_tokens: int = 400  # one tool result (conversations, re-sent outputs)
    rag_tokens: int = 320          # one retrieved passage (4 per request)

    def __post_init__(self):
        if min(self.doc_tokens, self.record_tokens, self.tool_output_tokens, self.rag_tokens) < 64 or self.tools < 1:
            raise ValueError("token sizes must be >= 64 and tools >= 1")


QUESTIONS = ["Which document mentions a date first?", "Summarise the documents in one sentence.",
             "Which organisation is named most often?", "List two numbers that appear above."]
PERSONAS = ["You are a support agent for an online shop.", "You are a travel assistant booking trips.",
            "You are a finance analyst answering briefly.", "You are an operations planner for a warehouse."]
STATUSES = ["PENDING", "SHIPPED", "DELAYED", "DELIVERED", "RETURNED", "LOST", "HELD", "CANCELLED"]
AGENTS = ["You are the planner agent: split the task into steps.",
          "You are the researcher agent: call tools to gather facts.",
          "You are the writer agent: write the final answer for the user."]


def catalogue(text: Text, n_tools: int) -> str:
    """A tool catalogue as frameworks paste it for a model without native tool calling: JSON
    function specs, one per line."""
    tools = []
    for i in range(n_tools):
        desc = text(40_000 + 211 * i, 40)
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}_{desc.split()[0].strip('.,;:').lower() or 'x'}", "description": desc,
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                           "required": ["query"]}}})
    return "Tools available (call one by answering with JSON {\"name\", \"arguments\"}):\n" + \
        "\n".join(json.dumps(t) for t in tools)


def reordered_docs(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """3 of 8 documents per request, subsets and order varying, then a question."""
    docs = [f"Document {j}:\n" + text(1_000 + 1_500 * j, sz.doc_tokens) for j in range(8)]
    out = []
    for r in range(turns):
        pick = rng.sample(range(8), 3)
        body = "Read these documents.\n\n" + "\n\n".join(docs[j] for j in pick)
        out.append([{"role": "user", "content": body + "\n\nQuestion: " + QUESTIONS[r % len(QUESTIONS)]}])
    return out


def _lines(prose: str, words: int = 12) -> list[str]:
    w = prose.split()
    return [" ".join(w[i:i + words]) for i in range(0, len(w), words)]


def edited_record(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """A ~1.2k-token record whose third line (a status field) changes every turn."""
    notes = _lines(text(20_000, sz.record_tokens - 40))
    out = []
    for r in range(turns):
        status = STATUSES[r % len(STATUSES)]
        rec = "\n".join(["Shipment record 4471", "Customer: Halden Freight Ltd", f"Status: {status}", *notes])
        out.append([{"role": "system", "content": "You track shipments. Answer in one word."},
                    {"role": "user", "content": rec + "\n\nWhat is the shipment status now?"}])
    return out


def shared_catalogue(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """One tool catalogue after a system line that varies among 4 personas."""
    cat = catalogue(text, sz.tools)
    return [[{"role": "system", "content": rng.choice(PERSONAS) + "\n\n" + cat},
             {"role": "user", "content": f"Request {r}: " + QUESTIONS[r % len(QUESTIONS)]}] for r in range(turns)]


def _tool_output(text: Text, i: int, sz: Sizes) -> str:
    return json.dumps({"call": i, "rows": _lines(text(60_000 + 977 * i, sz.tool_output_tokens - 20), 10)})


def growing_conversation(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """A tool-using conversation that grows by a call and its result every turn (prefix-friendly)."""
    msgs = [{"role": "system", "content": PERSONAS[0] + "\n\n" + catalogue(text, sz.tools)},
            {"role": "user", "content": "Find my last order and tell me when it arrives."}]
    out = []
    for r in range(turns):
        out.append([dict(m) for m in msgs])
        msgs += [{"role": "assistant", "content": json.dumps({"name": "tool_0", "arguments": {"query": f"step {r}"}})},
                 {"role": "user", "content": "Tool result:\n" + _tool_output(text, r, sz)}]
    return out


def rag_reranked(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """RAG: the top 4 of a pool of 6 passages by a reranker's score, numbered by rank (the label
    before each passage changes with its rank)."""
    pool = [text(80_000 + 1_300 * j, sz.rag_tokens) for j in range(6)]
    out = []
    for r in range(turns):
        ranked = sorted(range(6), key=lambda j: rng.random())[:4]
        ctx = "\n\n".join(f"[{k + 1}] {pool[j]}" for k, j in enumerate(ranked))
        out.append([{"role": "system", "content": "Answer from the context only; cite passages by number."},
                    {"role": "user", "content": f"Context:\n{ctx}\n\nQuestion: {QUESTIONS[r % len(QUESTIONS)]}"}])
    return out


def agent_handoffs(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """Multi-agent hand-offs: planner, researcher and writer take turns, each with its own system
    line and the shared catalogue, the notes handed on growing after it."""
    cat = catalogue(text, sz.tools)
    notes = [f"Note from step {i}: " + text(100_000 + 700 * i, 60) for i in range(turns)]
    return [[{"role": "system", "content": AGENTS[r % len(AGENTS)] + "\n\n" + cat},
             {"role": "user", "content": "Task: plan a delivery for order 4471.\n\nHand-off notes:\n"
                                         + "\n".join(notes[:r]) + "\n\nYour turn."}] for r in range(turns)]


def resent_tool_outputs(text: Text, turns: int, rng: random.Random, sz: Sizes) -> list[Messages]:
    """Tool outputs re-sent in later turns: the framework keeps the last two results after a
    running summary that grows a line every turn (the results recur at other offsets)."""
    outs = [_tool_output(text, 50 + i, sz) for i in range(turns + 1)]
    res = []
    for r in range(turns):
        kept = outs[max(0, r - 1):r + 1]
        res.append([{"role": "system", "content": "You are a research agent. Use the tool results."},
                    {"role": "user", "content": "Summary so far:\n" + "".join(f"- step {i}: called tool_{i % 3}\n"
                                                                              for i in range(r)) + "\n"
                                                + "\n\n".join(f"Tool result:\n{o}" for o in kept)
                                                + "\n\nWhat should the next call be?"}])
    return res


SHAPES: dict[str, tuple[str, Callable]] = {
    "docs": ("3 of 8 documents, subsets and order varying, then a question", reordered_docs),
    "record": ("a record whose third line (a status field) changes every turn", edited_record),
    "catalogue": ("one tool catalogue after a system line varying among 4 personas", shared_catalogue),
    "conversation": ("a growing tool-using conversation", growing_conversation),
    "rag": ("RAG: top 4 of 6 reranked passages, numbered by rank", rag_reranked),
    "handoff": ("multi-agent hand-offs sharing a catalogue", agent_handoffs),
    "resent": ("tool outputs re-sent in later turns after a changing summary", resent_tool_outputs),
}


def requests(text: Text, shapes: list[str], turns: int, seed: int, sz: Sizes) -> dict[str, list[Messages]]:
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or turns < 1:
        raise ValueError(f"unknown shape(s) {unknown} (known: {', '.join(SHAPES)}) or turns < 1")
    return {s: SHAPES[s][1](text, turns, random.Random(f"{seed}-{s}"), sz) for s in shapes}


# ---- the summary --------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def share(recs: list[dict], key: str) -> float:
    total = sum(r["prompt"] for r in recs)
    return sum(r.get(key, 0) for r in recs) / total if total else 0.0


def agreement(recs: list[dict], ref: list[dict]) -> tuple[int, int]:
    """(outputs equal to the reference's for the same request, requests compared)."""
    pairs = [(a, b) for a, b in zip(recs, ref) if a["request"] == b["request"]]
    return sum(a["text"] == b["text"] for a, b in pairs), len(pairs)


def _stage_medians(recs: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in recs for k in r.get("stages", {})})
    return {k: statistics.median(r["stages"].get(k, 0.0) for r in recs) for k in keys}


def _warm(kv: list[dict], vl: list[dict]) -> dict:
    """Reuse and TTFT p50 from turn 1 on (turn 0 is cold on both sides: what traffic that has
    been seen before gets), and over the second half of the turns (``late``: the steady state of
    a shape drawing from a pool, once most of it has been seen)."""
    a, b = [r for r in kv if r["turn"] > 0], [r for r in vl if r["turn"] > 0]
    half = (max((r["turn"] for r in kv), default=0) + 1) // 2
    la, lb = [r for r in kv if r["turn"] >= half], [r for r in vl if r["turn"] >= half]
    med = lambda xs: statistics.median(r["ttft"] for r in xs) if xs else float("nan")  # noqa: E731
    return {"kv_reused_warm": share(a, "cached"), "vllm_reused_warm": share(b, "cached"),
            "kv_p50_warm": med(a), "vllm_p50_warm": med(b), "late_from": half,
            "kv_reused_late": share(la, "cached"), "vllm_reused_late": share(lb, "cached"),
            "kv_p50_late": med(la), "vllm_p50_late": med(lb)}


def _cold_ratio(kv: list[dict], vl: list[dict]) -> float:
    """vLLM's TTFT / kvnotes' on turn 0 (nothing held on either side yet): the two engines' own
    speed on this machine, the baseline the reuse ratios are to be read against."""
    a = [r["ttft"] for r in kv if r["turn"] == 0]
    b = [r["ttft"] for r in vl if r["turn"] == 0]
    return statistics.median(b) / statistics.median(a) if a and b and statistics.median(a) else float("nan")


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, shape): kvnotes' reuse by kind and plain vLLM's, TTFT p50/p90 both,
    outputs equal to the reference (``exact``: plain vLLM's, i.e. a recompute's tokens; other
    policies: kvnotes ``exact``'s), the plans and the kvnotes stage medians."""
    rows = []
    for pol in dict.fromkeys(r["policy"] for r in records):
        exact_kv = [r for r in records if r["policy"] == "exact" and r["system"] == "kvnotes"]
        for shape in dict.fromkeys(r["shape"] for r in records if r["policy"] == pol):
            sel = lambda sysname, p=pol: [r for r in records if r["policy"] == p and r["shape"] == shape  # noqa: E731
                                          and r["system"] == sysname]
            kv, vl = sel("kvnotes"), sel("vllm")
            ref = vl if pol == "exact" else [r for r in exact_kv if r["shape"] == shape]
            same, n = agreement(kv, ref)
            rows.append({"policy": pol, "shape": shape, "requests": len(kv),
                         "prompt_mean": statistics.mean(r["prompt"] for r in kv) if kv else 0,
                         "kv_exact": share(kv, "exact"), "kv_composed": share(kv, "composed"),
                         "kv_edited": share(kv, "edited"), "kv_reused": share(kv, "cached"),
                         "vllm_reused": share(vl, "cached"),
                         "kv_p50": statistics.median(r["ttft"] for r in kv) if kv else float("nan"),
                         "kv_p90": pct([r["ttft"] for r in kv], 0.9),
                         "vllm_p50": statistics.median(r["ttft"] for r in vl) if vl else float("nan"),
                         "vllm_p90": pct([r["ttft"] for r in vl], 0.9),
                         "cold_ratio": _cold_ratio(kv, vl), **_warm(kv, vl),
                         "same": same, "compared": n, "reference": "vLLM" if pol == "exact" else "exact",
                         "same_prompt": sum(a["prompt"] == b["prompt"] for a, b in zip(kv, vl)),
                         "plans": dict(sorted({p: sum(r["plan"] == p for r in kv) for p in {r["plan"] for r in kv}}.items())),
                         "fallbacks": sum(len(r.get("fallbacks", [])) for r in kv),
                         "stages": _stage_medians(kv)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| policy | traffic | prompt (tokens) | reused kvnotes (exact + composed + edited) | reused vLLM "
             "| TTFT p50 kvnotes / vLLM (s) | p50 ratio vLLM/kvnotes (turn 0) | TTFT p90 kvnotes / vLLM (s) "
             "| outputs = reference | plans | turns 1+: reused kvnotes / vLLM, TTFT p50 kvnotes / vLLM (s) "
             "| 2nd half of the turns: the same |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        ratio = x["vllm_p50"] / x["kv_p50"] if x["kv_p50"] else float("nan")
        lines.append(
            f"| {x['policy']} | {x['shape']} | {x['prompt_mean']:.0f} | {x['kv_reused']:.0%} ({x['kv_exact']:.0%} + "
            f"{x['kv_composed']:.0%} + {x['kv_edited']:.0%}) | {x['vllm_reused']:.0%} | {x['kv_p50']:.2f} / "
            f"{x['vllm_p50']:.2f} | {ratio:.2f}x ({x['cold_ratio']:.2f}x) | {x['kv_p90']:.2f} / {x['vllm_p90']:.2f} | {x['same']}/{x['compared']} "
            f"({x['reference']}) | {', '.join(f'{k} {v}' for k, v in x['plans'].items())} | "
            f"{x.get('kv_reused_warm', 0):.0%} / {x.get('vllm_reused_warm', 0):.0%}, "
            f"{x.get('kv_p50_warm', float('nan')):.2f} / {x.get('vllm_p50_warm', float('nan')):.2f} | "
            f"turns {x.get('late_from', 0)}+: {x.get('kv_reused_late', 0):.0%} / {x.get('vllm_reused_late', 0):.0%}, "
            f"{x.get('kv_p50_late', float('nan')):.2f} / {x.get('vllm_p50_late', float('nan')):.2f} |")
    return "\n".join(lines)


def stage_table(rows: list[dict], top: int = 4) -> str:
    """The kvnotes stages with the most seconds (medians), per row: where its TTFT goes."""
    lines = ["| policy | traffic | largest kvnotes stages (median s) |", "|---|---|---|"]
    for x in rows:
        big = sorted(x["stages"].items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"| {x['policy']} | {x['shape']} | {', '.join(f'{k} {v:.2f}' for k, v in big)} |")
    return "\n".join(lines)
