"""The Grafana dashboard, generated from code: ``python -m cluster.dashboard > deploy/grafana/kvnotes.json``.

Every panel queries a metric defined in ``cluster.metrics`` (a test checks this), so the
dashboard cannot drift from what the router exports.
"""
from __future__ import annotations

import json
import sys

PANELS = [
    # (title, unit, [(promql, legend)])
    ("TTFT p50 / p90 by plan", "s", [
        ('histogram_quantile(0.5, sum by (le, plan) (rate(kvnotes_ttft_seconds_bucket[5m])))', "p50 {{plan}}"),
        ('histogram_quantile(0.9, sum by (le, plan) (rate(kvnotes_ttft_seconds_bucket[5m])))', "p90 {{plan}}")]),
    ("Requests by plan and status", "reqps", [
        ("sum by (plan, status) (rate(kvnotes_requests_total[5m]))", "{{plan}} {{status}}")]),
    ("Prompt tokens by source (reused vs recomputed)", "short", [
        ("sum by (source) (rate(kvnotes_prompt_tokens_total[5m]))", "{{source}}")]),
    ("Tier hit rate", "percentunit", [
        ("sum(rate(kvnotes_tier_hits_total[5m])) / clamp_min(sum(rate(kvnotes_tier_lookups_total[5m])), 1e-9)",
         "hit rate")]),
    ("KV transfer throughput", "Bps", [
        ("sum by (transport) (rate(kvnotes_kv_transfer_bytes_total[5m]))", "{{transport}}")]),
    ("KV transfer p90 latency", "s", [
        ("histogram_quantile(0.9, sum by (le, transport) (rate(kvnotes_kv_transfer_seconds_bucket[5m])))",
         "{{transport}}")]),
    ("Fallbacks by reason", "short", [
        ("sum by (reason) (increase(kvnotes_fallbacks_total[5m]))", "{{reason}}")]),
    ("RoPE self-test (1 = passed)", "short", [("kvnotes_rope_selftest_ok", "{{worker}}")]),
    ("Fidelity: logit cosine p10 (shadow checks)", "short", [
        ("histogram_quantile(0.1, sum by (le) (rate(kvnotes_fidelity_cosine_bucket[30m])))", "p10")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": "kvnotes", "uid": "kvnotes-overview", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["kvnotes"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    json.dump(dashboard(), sys.stdout, indent=2)
    sys.stdout.write("\n")
