"""``bench.agent_traffic``'s prompts and summary on made-up numbers (no model, no servers): each
shape has the structure it names (what recurs, where, what changes), and the table's shares,
TTFT ratios and agreement come from the records."""
import random

import pytest

from bench.agent_traffic_shapes import (PERSONAS, SHAPES, Sizes, agreement, markdown, requests, share, stage_table,
                                        summarize)

SZ = Sizes(doc_tokens=80, record_tokens=120, tools=3, tool_output_tokens=80, rag_tokens=64)


def text(offset: int, n: int) -> str:
    return " ".join(f"w{offset + i}" for i in range(n))


def traffic(turns=6):
    return requests(text, list(SHAPES), turns, 0, SZ)


def test_documents_three_of_eight_with_subsets_and_order_varying():
    reqs = traffic()["docs"]
    picks = []
    for msgs in reqs:
        body = msgs[0]["content"]
        picks.append([int(line.split()[1].rstrip(":")) for line in body.splitlines() if line.startswith("Document ")])
        assert len(picks[-1]) == 3 and len(set(picks[-1])) == 3 and "\n\nQuestion: " in body
    assert len({tuple(p) for p in picks}) > 1 and len({frozenset(p) for p in picks}) > 1


def test_the_record_changes_only_in_its_third_line():
    reqs = traffic()["record"]
    recs = [m[1]["content"].splitlines() for m in reqs]
    assert all(r[2].startswith("Status: ") for r in recs)
    for a, b in zip(recs, recs[1:]):
        assert a[2] != b[2] and a[:2] + a[3:] == b[:2] + b[3:]


def test_one_catalogue_after_a_persona_line():
    reqs = traffic(8)["catalogue"]
    heads, cats = zip(*(m[0]["content"].split("\n\n", 1) for m in reqs))
    assert len(set(cats)) == 1 and "tool_0_" in cats[0]
    assert set(heads) <= set(PERSONAS) and len(set(heads)) > 1


def test_the_conversation_grows_by_appending():
    reqs = traffic()["conversation"]
    for a, b in zip(reqs, reqs[1:]):
        assert b[:len(a)] == a and len(b) == len(a) + 2


def test_rag_numbers_passages_by_rank_and_reorders_them():
    reqs = traffic()["rag"]
    orders = []
    for m in reqs:
        ctx = m[1]["content"]
        assert all(f"[{k}] " in ctx for k in range(1, 5)) and "[5] " not in ctx
        orders.append(tuple(line.split(" ", 1)[1][:8] for line in ctx.split("\n\n") if line.startswith("[")))
    assert len(set(orders)) > 1


def test_handoffs_share_the_catalogue_after_each_agent_line_and_carry_growing_notes():
    reqs = traffic()["handoff"]
    cats = {m[0]["content"].split("\n\n", 1)[1] for m in reqs}
    agents = {m[0]["content"].split("\n\n", 1)[0] for m in reqs}
    assert len(cats) == 1 and len(agents) == 3
    notes = [m[1]["content"].count("Note from step") for m in reqs]
    assert notes == list(range(len(reqs)))


def test_a_tool_output_is_resent_at_another_offset():
    reqs = traffic()["resent"]
    for a, b in zip(reqs, reqs[1:]):
        last = a[1]["content"].split("Tool result:\n")[-1].split("\n\n")[0]
        assert last in b[1]["content"] and a[1]["content"].index(last) != b[1]["content"].index(last)


def test_the_same_seed_gives_the_same_prompts_and_bad_input_is_refused():
    assert traffic() == traffic()
    with pytest.raises(ValueError, match="unknown shape"):
        requests(text, ["nope"], 2, 0, SZ)
    with pytest.raises(ValueError, match=">= 64"):
        Sizes(doc_tokens=10)
    assert random.Random(0).random() == random.Random(0).random()


def _rec(policy, system, shape, turn, ttft, text_, prompt=1000, exact=0, composed=0, edited=0, plan="recompute",
         stages=None):
    return {"policy": policy, "system": system, "shape": shape, "turn": turn, "request": f"{shape}-{turn}",
            "ttft": ttft, "text": text_, "prompt": prompt, "cached": exact + composed + edited, "exact": exact,
            "composed": composed, "edited": edited, "plan": plan, "fallbacks": [], "stages": stages or {}}


def _records():
    return [
        _rec("exact", "kvnotes", "docs", 0, 2.0, "A"), _rec("exact", "vllm", "docs", 0, 1.8, "A", exact=200),
        _rec("exact", "kvnotes", "docs", 1, 1.0, "B", exact=500), _rec("exact", "vllm", "docs", 1, 1.2, "X", exact=200),
        _rec("fast", "kvnotes", "docs", 0, 0.5, "A", exact=100, composed=800, plan="reposition",
             stages={"forward": 0.2, "control.plan": 0.01}),
        _rec("fast", "vllm", "docs", 0, 2.0, "A", exact=200),
        _rec("fast", "kvnotes", "docs", 1, 0.3, "C", exact=100, edited=800, plan="edit_in_place",
             stages={"forward": 0.1, "control.plan": 0.03}),
        _rec("fast", "vllm", "docs", 1, 1.0, "B", exact=200),
    ]


def test_summary_shares_ratios_and_agreement_from_the_records():
    rows = {(x["policy"], x["shape"]): x for x in summarize(_records())}
    ex, fast = rows[("exact", "docs")], rows[("fast", "docs")]
    assert ex["kv_exact"] == 0.25 and ex["vllm_reused"] == 0.2 and ex["kv_reused"] == 0.25
    assert (ex["same"], ex["compared"], ex["reference"]) == (1, 2, "vLLM")        # "B" vs vLLM's "X"
    assert (fast["same"], fast["compared"], fast["reference"]) == (1, 2, "exact")  # "A" = exact's, "C" != "B"
    assert fast["kv_composed"] == 0.4 and fast["kv_edited"] == 0.4 and fast["kv_reused"] == 0.9
    assert fast["kv_p50"] == pytest.approx(0.4) and fast["vllm_p50"] == pytest.approx(1.5)
    assert fast["plans"] == {"edit_in_place": 1, "reposition": 1}
    assert fast["stages"] == {"control.plan": pytest.approx(0.02), "forward": pytest.approx(0.15)}
    table = markdown(list(rows.values()))
    assert fast["cold_ratio"] == pytest.approx(2.0 / 0.5) and ex["cold_ratio"] == pytest.approx(1.8 / 2.0)
    assert "| fast | docs | 1000 | 90% (10% + 40% + 40%) | 20% | 0.40 / 1.50 | 3.75x (4.00x) |" in table
    assert "1/2 (vLLM)" in table and "1/2 (exact)" in table
    assert fast["kv_reused_warm"] == pytest.approx(0.9) and fast["kv_p50_warm"] == pytest.approx(0.3)
    assert "| 90% / 20%, 0.30 / 1.00 |" in table                                   # turn 1 on
    assert "forward 0.15, control.plan 0.02" in stage_table(list(rows.values()))


def test_share_and_agreement_edges():
    assert share([], "cached") == 0.0
    a = [_rec("fast", "kvnotes", "docs", 0, 1.0, "A")]
    b = [_rec("exact", "kvnotes", "record", 0, 1.0, "A")]
    assert agreement(a, b) == (0, 0)          # different requests are never compared
