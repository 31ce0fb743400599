"""``bench.online_edit``'s arithmetic on recorded numbers (no servers): Poisson arrivals, the
per-rate summary (hit rate from cached/prompt tokens, TTFT percentiles, achieved throughput, errors
counted), the targets at the highest offered rate, and the tables."""
import math

from bench.online_edit import SYSTEMS, arrivals, markdown, percentile, summarise, targets


def test_arrivals_are_poisson_at_the_rate_and_reproducible():
    a = arrivals(4.0, 4000, seed=3)
    assert a[0] == 0.0 and a == sorted(a) and a == arrivals(4.0, 4000, seed=3)
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.25) < 0.02                               # 1 / rate
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(math.sqrt(var) / mean - 1.0) < 0.1                # exponential: sd == mean


def test_summary_counts_errors_and_weights_the_hit_rate_by_tokens():
    recs = [{"ttft": 0.1, "prompt": 1000, "cached": 990, "end": 1.0},
            {"ttft": 0.3, "prompt": 1000, "cached": 1000, "end": 2.0},
            {"error": "HTTP 503", "end": 0.5}]
    m = summarise(recs)
    assert m["n"] == 3 and m["errors"] == 1
    assert m["hit"] == 1990 / 2000 and m["throughput"] == 2 / 2.0
    assert abs(m["p50"] - 0.2) < 1e-12 and abs(m["p90"] - 0.28) < 1e-12
    assert math.isnan(percentile([], 0.5))


def _run(kv_p90: float, kv_thr: float, hit: float) -> dict:
    def m(p90, thr, h):
        return {"n": 96, "errors": 0, "hit": h, "p50": p90 / 2, "p90": p90, "throughput": thr}
    rates = []
    for rate, vp90, vthr in ((0.5, 2.0, 0.5), (4.0, 100.0, 0.8)):
        rates.append({"rate": rate, "systems": {SYSTEMS[0]: m(kv_p90, kv_thr, hit), SYSTEMS[1]: m(kv_p90 * 4, kv_thr / 2, 0.8),
                                                 SYSTEMS[2]: m(vp90, vthr, 0.05)}})
    return {"model": "m", "dtype": "float32", "requests": 96, "sessions": 8, "max_tokens": 8,
            "sizes": {"1024": {"capacity": 0.7, "rates": rates}}}


def test_targets_are_judged_at_the_highest_rate_and_the_lowest_hit_rate():
    got = {(t["system"], t["target"].split()[0]): t for t in targets(_run(kv_p90=1.0, kv_thr=4.5, hit=0.99))}
    assert got[(SYSTEMS[0], "hit")]["pass"] and got[(SYSTEMS[0], "hit")]["value"] == 0.99
    assert got[(SYSTEMS[0], "p90")]["value"] == 100.0 and got[(SYSTEMS[0], "p90")]["pass"]
    assert abs(got[(SYSTEMS[0], "throughput")]["value"] - 4.5 / 0.8) < 1e-12 and got[(SYSTEMS[0], "throughput")]["pass"]
    # edit-in-place: 4x the p90 (25x lower: a miss), half the throughput (2.8x: a miss), hit 80%: a miss
    assert not any(got[(SYSTEMS[1], k)]["pass"] for k in ("hit", "p90", "throughput"))


def test_markdown_shows_every_system_and_the_ratios():
    text = markdown(_run(kv_p90=1.0, kv_thr=4.5, hit=0.99))
    assert sum(line.startswith("| 4.00 |") for line in text.splitlines()) == 3 and "100.0x lower" in text and "5.6x" in text
    assert "| 1024 | kvnotes erratum | hit rate >= 98% (lowest over rates) | 99.0% | met |" in text


def test_saved_runs_merge_by_size_and_rate():
    from bench.online_edit import merge
    def run(size, rate, sessions, n):
        m = {"n": n, "errors": 0, "hit": 1.0, "p50": 1.0, "p90": 2.0, "throughput": 0.5}
        return {"model": "m", "dtype": "float32", "max_tokens": 8, "requests": n, "sessions": sessions, "command": f"c{rate}",
                "sizes": {str(size): {"capacity": 0.4, "rates": [{"rate": rate, "systems": {k: m for k in SYSTEMS}}]}}}
    r = merge([run(1024, 1.6, 8, 96), run(1024, 0.2, 8, 24), run(4096, 0.3, 4, 24)])
    assert [row["rate"] for row in r["sizes"]["1024"]["rates"]] == [0.2, 1.6]
    assert r["sizes"]["4096"]["sessions"] == 4 and r["command"] == "c1.6 ; c0.2 ; c0.3"
    text = markdown(r)
    assert "requests per rate as the table says" in text and "| 0.20 | vLLM APC | 24 |" in text
