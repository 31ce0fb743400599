"""Pure functions over ``bench.cluster_vs_vllm`` results: percentiles, per-size ratios, the
targets against plain vLLM (pass/miss, by how much, which kvnotes stage holds a miss back) and the
markdown tables. No I/O, no model: ``tests/test_bench_cluster_vs_vllm.py`` runs them on
recorded numbers.

A result (``r``) is JSON: ``r["sizes"][str(size)]`` holds, per workload, lists of request records
(``{"ttft", "prompt", "cached", "plan", "stages", ...}``) for each system; ``r["inprocess"][str(size)]``
the in-process compose seconds; ``r["load"]`` the mixed Poisson runs.
"""
from __future__ import annotations

import statistics

# the targets against plain vLLM (what composing must buy): key, description, size rule, goal, higher ratio is better
COMPOSE_VS_RECOMPUTE = 20.0    # compose TTFT at 8k >= 20x lower than plain vLLM's recompute
COMPOSE_VS_HIT = 2.0           # at 4k within 2x of vLLM's exact prefix-cache hit
COLD_PARITY = 1.2              # cold prompts within 1.2x of plain vLLM
EDIT_P90 = 5.0                 # field-edit p90 >= 5x lower than plain vLLM with prefix caching
KEPT = 0.70                    # the cluster keeps >= 70% of the in-process speed-up
OUTSIDE = "outside the KV path (HTTP, Serve, Ray, planning)"


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100] (p50 of an even count: the upper middle)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def p50(recs: list[dict]) -> float:
    return statistics.median([x["ttft"] for x in recs]) if recs else float("nan")


def p90(recs: list[dict]) -> float:
    return pct([x["ttft"] for x in recs], 90)


def stage_means(recs: list[dict]) -> dict[str, float]:
    """Mean seconds per kvnotes stage over ``recs``, plus the client TTFT not covered by any stage."""
    if not recs:
        return {}
    names = [k for r in recs for k in r.get("stages", {})]
    out = {k: statistics.mean(r.get("stages", {}).get(k, 0.0) for r in recs) for k in dict.fromkeys(names)}
    # first_token is measured from the engine's add (it contains receive/load/suffix_forward there);
    # outside = client TTFT minus the prefill side's stages and the decode engine's first token
    inner = sum(v for k, v in out.items() if k in ("tier_get", "rerotate", "forward", "serialise", "transfer",
                                                   "first_token"))
    out[OUTSIDE] = max(0.0, statistics.mean(r["ttft"] for r in recs) - inner)
    return out


OUTSIDE_PARTS = ("router before the grant", "grant call (decode actor: hold + expect)",
                 "prefill build beyond tier_get / rerotate / forward",
                 "prefill call beyond build + send (Ray, tier store of the prefix, result)",
                 "decode call beyond the engine's first_token (Ray stream, actor)", "router <-> client (HTTP, SSE)")


def outside_parts(recs: list[dict]) -> dict[str, float]:
    """Mean seconds of what makes up :data:`OUTSIDE`, from the router's laps (``explain.control``):
    empty when a record has none (runs before the laps were recorded)."""
    if not recs or not all(r.get("control", {}).get("laps") for r in recs):
        return {}
    parts = []
    for r in recs:
        laps, st = {}, r.get("stages", {})
        for name, sec in r["control"]["laps"]:
            laps[name] = laps.get(name, 0.0) + sec
        w = r["control"].get("worker", {})
        calls = ("expect_call", "prefill_call", "decode_call")
        build = sum(st.get(k, 0.0) for k in ("tier_get", "rerotate", "forward"))
        vals = (sum(v for k, v in laps.items() if k not in calls), laps.get("expect_call", 0.0),
                w.get("prefill_build", 0.0) - build if "prefill_build" in w else 0.0,
                laps.get("prefill_call", 0.0) - w.get("prefill_build", 0.0) - w.get("prefill_send", 0.0),
                laps.get("decode_call", 0.0) - st.get("first_token", 0.0), r["ttft"] - sum(laps.values()))
        parts.append(dict(zip(OUTSIDE_PARTS, vals)))
    return {k: statistics.mean(p[k] for p in parts) for k in OUTSIDE_PARTS}


def largest_stage(recs: list[dict]) -> str:
    """``name s (share%)`` of the stage with the most seconds (``first_token`` split into its parts
    when receive/load/suffix_forward are reported), or ``-`` without stage timings."""
    m = stage_means(recs)
    if not m:
        return "-"
    parts = {k: v for k, v in m.items() if k != "first_token"}
    if "first_token" in m:                   # the decode engine's own compute, net of receive/load
        parts["first_token (decode engine)"] = max(0.0, m["first_token"] - sum(m.get(k, 0.0) for k in
                                                                               ("receive", "load")))
    name, sec = max(parts.items(), key=lambda kv: kv[1])
    total = statistics.mean(r["ttft"] for r in recs)
    return f"{name} {sec:.2f} s ({sec / total:.0%} of {total:.2f} s)"


def size_rows(r: dict) -> list[dict]:
    """One row per size: p50/p90 per system and the side-by-side ratios."""
    rows = []
    for size, w in sorted(r["sizes"].items(), key=lambda kv: int(kv[0])):
        c, cold, ed = w.get("compose", {}), w.get("cold", {}), w.get("edit", {})
        row = {"size": int(size)}
        if c.get("kvnotes"):
            k, rec, hit = p50(c["kvnotes"]), p50(c["vllm_recompute"]), p50(c["vllm_hit"])
            row.update(prompt=c["kvnotes"][0]["prompt"], compose=k, recompute=rec, hit=hit,
                       vs_recompute=rec / k, vs_hit=k / hit, compose_recs=c["kvnotes"])
            t_in = r.get("inprocess", {}).get(size)
            if t_in:
                row.update(inprocess=statistics.median(t_in), inproc_speedup=rec / statistics.median(t_in),
                           kept=statistics.median(t_in) / k)
        if cold.get("kvnotes"):
            row.update(cold_k=p50(cold["kvnotes"]), cold_v=p50(cold["vllm"]),
                       cold_ratio=p50(cold["kvnotes"]) / p50(cold["vllm"]), cold_recs=cold["kvnotes"])
        if ed.get("kvnotes"):
            row.update(edit_k50=p50(ed["kvnotes"]), edit_k90=p90(ed["kvnotes"]), edit_v50=p50(ed["vllm"]),
                       edit_v90=p90(ed["vllm"]), edit_ratio=p90(ed["vllm"]) / p90(ed["kvnotes"]),
                       edit_plans=sorted({x.get("plan", "?") for x in ed["kvnotes"]}), edit_recs=ed["kvnotes"])
        rows.append(row)
    return rows


def _check(name: str, size: int, value: float, goal: float, higher: bool, unit: str, recs: list[dict]) -> dict:
    ok = value >= goal if higher else value <= goal
    if higher:
        by = f"{value / goal - 1:+.0%} vs goal" if ok else f"{1 - value / goal:.0%} short (kvnotes must get {goal / value:.2f}x faster)"
    else:
        by = f"{1 - value / goal:.0%} under the bound" if ok else f"{value / goal - 1:.0%} over (kvnotes must get {value / goal:.2f}x faster)"
    return {"target": name, "size": size, "value": value, "goal": goal, "higher": higher, "unit": unit,
            "pass": ok, "by": by, "holding": "" if ok else largest_stage(recs)}


def evaluate(r: dict) -> list[dict]:
    """Every target this run measured, with pass/miss, margin and (on a miss) the largest stage."""
    out = []
    for row in size_rows(r):
        s = row["size"]
        if "vs_recompute" in row and s >= 8000:
            out.append(_check("compose TTFT >= 20x lower than plain vLLM recompute", s, row["vs_recompute"],
                              COMPOSE_VS_RECOMPUTE, True, "x", row["compose_recs"]))
        if "vs_hit" in row and 3500 <= s < 6000:
            out.append(_check("compose TTFT within 2x of plain vLLM's exact prefix-cache hit", s, row["vs_hit"],
                              COMPOSE_VS_HIT, False, "x slower", row["compose_recs"]))
        if "cold_ratio" in row:
            out.append(_check("cold prompt within 1.2x of plain vLLM", s, row["cold_ratio"], COLD_PARITY, False,
                              "x", row["cold_recs"]))
        if "edit_ratio" in row:
            out.append(_check("field-edit p90 >= 5x lower than plain vLLM (APC on)", s, row["edit_ratio"], EDIT_P90,
                              True, "x", row["edit_recs"]))
        if "kept" in row:
            out.append(_check("cluster keeps >= 70% of the in-process speed-up", s, row["kept"], KEPT, True,
                              "", row["compose_recs"]))
    return out


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(r: dict) -> str:
    rows = size_rows(r)
    lines = ["### Side by side (client-side TTFT over HTTP, seconds, p50 unless marked)", "",
             "| context | kvnotes compose | vLLM recompute | vLLM exact hit | compose vs recompute | compose / hit "
             "| in-process compose | in-process speed-up | kept | cold kvnotes | cold vLLM | cold ratio "
             "| edit kvnotes p50 / p90 | edit vLLM p50 / p90 | edit p90 ratio | edit plans |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        g = x.get
        lines.append(
            f"| {g('prompt', x['size'])} | {_f(g('compose'))} | {_f(g('recompute'))} | {_f(g('hit'))} "
            f"| {_f(g('vs_recompute'), '.1f')}x | {_f(g('vs_hit'), '.1f')}x | {_f(g('inprocess'))} "
            f"| {_f(g('inproc_speedup'), '.1f')}x | {_f(g('kept'), '.0%')} | {_f(g('cold_k'))} | {_f(g('cold_v'))} "
            f"| {_f(g('cold_ratio'))}x | {_f(g('edit_k50'))} / {_f(g('edit_k90'))} "
            f"| {_f(g('edit_v50'))} / {_f(g('edit_v90'))} | {_f(g('edit_ratio'), '.1f')}x | {', '.join(g('edit_plans', []))} |")
    lines += ["", "### Targets", "", "| target | context | measured | goal | result | by how much "
              "| largest kvnotes stage (on a miss) |", "|---|---|---|---|---|---|---|"]
    for t in evaluate(r):
        val = f"{t['value']:.0%}" if t["unit"] == "" else f"{t['value']:.2f}{t['unit'][:1]}"
        goal = f"{'>=' if t['higher'] else '<='} {t['goal']:.0%}" if t["unit"] == "" else \
            f"{'>=' if t['higher'] else '<='} {t['goal']:g}x"
        lines.append(f"| {t['target']} | {t['size']} | {val} | {goal} | {'pass' if t['pass'] else '**miss**'} "
                     f"| {t['by']} | {t['holding'] or '-'} |")
    lines += ["", "### kvnotes stage breakdown (mean seconds per request; explain.stages from the final event)", "",
              "| workload | context | client TTFT | " + " | ".join(STAGE_COLS) + " | outside KV path |",
              "|---|---|---|" + "---|" * (len(STAGE_COLS) + 1)]
    for x in rows:
        for wl, key in (("compose", "compose_recs"), ("cold", "cold_recs"), ("field edit", "edit_recs")):
            recs = x.get(key)
            if not recs:
                continue
            m = stage_means(recs)
            lines.append(f"| {wl} | {x['size']} | {statistics.mean(q['ttft'] for q in recs):.2f} | "
                         + " | ".join(_f(m.get(k)) for k in STAGE_COLS) + f" | {m[OUTSIDE]:.2f} |")
    lines += outside_rows(rows)
    lines += floor_rows(r)
    fell = [(wl, size, f) for size, w in r["sizes"].items() for wl, d in w.items() for x in d.get("kvnotes", [])
            for f in x.get("fallbacks", [])]
    lines += ["", f"kvnotes requests that fell back to recompute: {len(fell)}"
              + (f" ({', '.join(f'{wl} {sz}: {f}' for wl, sz, f in fell)})" if fell else "")]
    if r.get("load"):
        lines += ["", "### Mixed Poisson load (compose + cold + field edit, one third each)", "",
                  "| offered (req/s) | system | requests | p50 TTFT | p90 TTFT | p90 compose | p90 cold | p90 edit "
                  "| achieved (req/s) |", "|---|---|---|---|---|---|---|---|---|"]
        for ld in r["load"]:
            recs = ld["records"]
            by = {k: [x for x in recs if x["kind"] == k] for k in ("compose", "cold", "edit")}
            lines.append(f"| {ld['rate']} | {ld['system']} | {len(recs)} | {p50(recs):.2f} | {p90(recs):.2f} "
                         f"| {_f(p90(by['compose']) if by['compose'] else None)} "
                         f"| {_f(p90(by['cold']) if by['cold'] else None)} "
                         f"| {_f(p90(by['edit']) if by['edit'] else None)} | {len(recs) / ld['span']:.2f} |")
    return "\n".join(lines)


def outside_rows(rows: list[dict]) -> list[str]:
    """Where the compose rows' "outside the KV path" goes (:func:`outside_parts`); empty without laps."""
    got = [(x, outside_parts(x.get("compose_recs", []))) for x in rows]
    got = [(x, p) for x, p in got if p]
    if not got:
        return []
    out = ["", "### Where compose's \"outside the KV path\" goes (mean seconds; the router's explain.control laps)", "",
           "| context | outside KV path | " + " | ".join(OUTSIDE_PARTS) + " |", "|---|---|" + "---|" * len(OUTSIDE_PARTS)]
    for x, p in got:
        out.append(f"| {x['size']} | {stage_means(x['compose_recs'])[OUTSIDE]:.3f} | "
                   + " | ".join(f"{p[k]:.3f}" for k in OUTSIDE_PARTS) + " |")
    return out


def floor_rows(r: dict) -> list[str]:
    """The composed prompt against vLLM's exact hit plus its KV bytes moved once at the measured
    copy rate (and at the nominal bandwidth when given): what a decode leg at copy speed would cost
    (issue 47). Empty for a run that measured no copy rate."""
    dev = r.get("device")
    if not dev:
        return []
    copy, nominal, per_token = dev["copy_gbs"], dev.get("nominal_gbs"), dev["kv_bytes_per_token"]
    at = f"{nominal:g} GB/s nominal" if nominal else "nominal (not given: --nominal-gbs)"
    out = ["", f"### The decode leg against its byte floor (copy measured at {copy:.1f} GB/s; {at})", "",
           "| context | KV bytes | bytes at copy rate | bytes at nominal | transfer + receive + load (measured) "
           "| kvnotes compose | vLLM exact hit | hit + bytes at copy rate | compose / (hit + bytes) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for x in size_rows(r):
        if "compose" not in x:
            continue
        nbytes = x["prompt"] * per_token
        fc = nbytes / (copy * 1e9)
        fn = f"{nbytes / (nominal * 1e9):.3f} s" if nominal else "-"
        m = stage_means(x["compose_recs"])
        moved = sum(m.get(k, 0.0) for k in ("transfer", "receive", "load"))
        out.append(f"| {x['prompt']} | {nbytes / 1e6:.0f} MB | {fc:.3f} s | {fn} | {moved:.3f} s | {x['compose']:.2f} "
                   f"| {x['hit']:.2f} | {x['hit'] + fc:.2f} | {x['compose'] / (x['hit'] + fc):.2f}x |")
    return out


STAGE_COLS = ("tier_get", "rerotate", "forward", "serialise", "transfer", "receive", "load", "suffix_forward",
              "first_token")
