"""The Grafana dashboard, built with grafana-foundation-sdk: ``python -m cluster.operator.dashboard``
rewrites ``deploy/grafana/kvnotes.json`` (``--out -`` prints it instead).

The panels are data (:data:`ROWS`); :func:`dashboard` turns them into Grafana JSON with the
SDK's builders. The SDK is a test/build-time dependency only: it is imported inside
:func:`dashboard`, so importing this module (or anything in ``cluster``) never needs it.

Aggregation: every process (router replicas, prefill and decode actors, vLLM engines) exports
its own series, so counters and histograms are summed across processes with ``sum by (...)``
before ``rate``-derived ratios and quantiles. Two state gauges are not sums: every router
replica reports the same ``kvnotes_workers_alive{role}`` count (``max by (role)``), and
``kvnotes_tier_remote_up`` is 0 where any process cannot reach the remote tier (``min``).

:data:`METRICS` lists every metric the dashboard queries (kvnotes' own, :mod:`cluster.control.metrics`,
and vLLM's; docs/observability.md); ``tests/test_dashboard_alerts.py`` checks it matches the panels' queries and
``tests/test_deploy.py`` checks it against what the code exports.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

DASHBOARD_JSON = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvnotes.json"

# Every metric the panels query, as Prometheus names them (histograms by their base name:
# the panels read ``<name>_bucket`` / ``_count``).
METRICS = (
    "kvnotes_ttft_seconds",                   # histogram {plan}: the plan that executed
    "kvnotes_requests_total",                 # counter {plan, status, outcome}: every request once
    "kvnotes_prompt_tokens_total",            # counter {source=reused|repositioned|erratum|decode_cache|computed}
    "kvnotes_reused_tokens_total",            # counter {kind=exact|composed|edited}: usage.prompt_tokens_details' split
    "kvnotes_reuse_miss_total",               # counter {reason}: prompt tokens computed though matching ran
    "kvnotes_tier_hits_total",                # counter {tier}
    "kvnotes_tier_lookups_total",             # counter {tier}, plan-time misses included
    "kvnotes_kv_transfer_bytes_total",        # counter {transport}
    "kvnotes_stage_seconds",                  # histogram {stage, transport}
    "kvnotes_fallbacks_total",                # counter {reason}
    "kvnotes_retries_total",                  # counter {role, reason}
    "kvnotes_workers_alive",                  # gauge {role}
    "kvnotes_shed_total",                     # counter {reason}: refused at admission (cluster.control.admission)
    "kvnotes_admission_queue_depth",          # gauge, per router replica
    "kvnotes_admission_predicted_wait_seconds",  # gauge, per router replica
    "kvnotes_admission_service_interval_seconds",  # gauge, per router replica
    "kvnotes_admission_ttft_budget_seconds",      # gauge, per router replica (0 while off)
    "kvnotes_admission_slowdown",             # gauge, per router replica: measured / modelled first token
    "kvnotes_admission_peer_queued",          # gauge, per router replica: the others' queues it last heard
    "kvnotes_admission_exchanges_total",      # counter {result}: checks of the others' queues now (cluster.control.exchange)
    "kvnotes_admission_exchange_seconds",     # histogram: how long those checks took
    "kvnotes_tier_remote_up",                 # gauge, 1 = the remote tier answers
    "kvnotes_rope_selftest_ok",               # gauge {worker}, 1 = the RoPE self-test passed
    "kvnotes_fidelity_agree_total",           # counter {op, metric}: shadow checks that agreed
    "kvnotes_fidelity_kl",                    # histogram {op}: one observation per shadow check
    "kvnotes_fidelity_exact_mismatch_total",  # counter {op}: checks of an exact op (reuse(frame)) that disagreed
    "vllm:time_to_first_token_seconds",       # histogram {model_name, engine} (decode actors)
    "vllm:prefix_cache_queries_total",        # counter, prompt tokens looked up in vLLM's cache
    "vllm:prefix_cache_hits_total",           # counter, of those found in vLLM's own cache
    "vllm:external_prefix_cache_hits_total",  # counter, found by the kvnotes KV connector
    "ray_serve_num_http_requests_total",      # counter {application, route, method, status_code} (Ray nodes)
    "ray_serve_http_request_latency_ms",      # histogram {application, route}: Serve's proxy, ms
    "ray_serve_replica_processing_queries",   # gauge {deployment, replica}: requests in a router replica
)


class Query(NamedTuple):
    expr: str    # PromQL
    legend: str  # Grafana legend format ("{{label}}")


class Panel(NamedTuple):
    title: str
    unit: str                  # Grafana unit id ("s", "Bps", "percentunit", ...)
    queries: tuple[Query, ...]
    description: str
    kind: str = "timeseries"   # "timeseries" | "stat"
    stacked: bool = False      # timeseries only: stack the series (parts of a whole)
    dash_recompute: bool = False  # timeseries only: draw series named "...recompute..." dashed


class Row(NamedTuple):
    title: str
    panels: tuple[Panel, ...]


def _q(quantile: float, histogram: str, by: str, window: str = "5m", match: str = "") -> str:
    """PromQL for one quantile of a histogram summed across processes, grouped by ``by``."""
    group = f"le, {by}" if by else "le"
    return (f"histogram_quantile({quantile}, sum by ({group}) "
            f"(rate({histogram}_bucket{match}[{window}])))")


ROWS = (
    Row("Latency", (
        Panel("TTFT p50 / p90 by executed plan", "s", (
            Query(_q(0.5, "kvnotes_ttft_seconds", "plan"), "p50 {{plan}}"),
            Query(_q(0.9, "kvnotes_ttft_seconds", "plan"), "p90 {{plan}}"),
        ), "Time to first token by the plan that executed (a fallback counts as the recompute it "
           "ran). The recompute lines (dashed) are the baseline every other plan should beat.",
           dash_recompute=True),
        Panel("TTFT p50: speed-up over recompute", "suffix:x", (
            Query(_q(0.5, "kvnotes_ttft_seconds", "", match='{plan="recompute"}')
                  + " / on () group_right () "
                  + _q(0.5, "kvnotes_ttft_seconds", "plan", match='{plan!="recompute"}'),
                  "{{plan}}"),
        ), "Recompute TTFT p50 divided by each plan's TTFT p50 (2 = twice as fast as recompute)."),
    )),
    Row("Reuse", (
        Panel("Prompt tokens by source", "short", (
            Query("sum by (source) (rate(kvnotes_prompt_tokens_total[5m]))", "{{source}}"),
        ), "Prompt tokens per second by where their KV came from: reused, repositioned, erratum "
           "(appended correction) or computed.", stacked=True),
        Panel("Share of prompt tokens not computed", "percentunit", (
            Query('sum(rate(kvnotes_prompt_tokens_total{source!="computed"}[5m])) '
                  "/ sum(rate(kvnotes_prompt_tokens_total[5m]))", "reused share"),
        ), "Fraction of prompt tokens whose KV was reused, repositioned or corrected by an "
           "erratum instead of computed."),
        Panel("Reused prompt tokens by kind", "short", (
            Query("sum by (kind) (rate(kvnotes_reused_tokens_total[5m]))", "{{kind}}"),
            Query('sum(rate(kvnotes_prompt_tokens_total{source="computed"}[5m]))', "computed"),
        ), "Prompt tokens per second nobody computed, by kind of reuse (the split of "
           "usage.prompt_tokens_details.cached_tokens): exact (bit for bit a prefill's: the prompt index, "
           "the decode engine's prefix cache), composed (repositioned chunks and recurring spans), edited (a "
           "held prompt's KV edited), beside the computed ones.", stacked=True),
        Panel("Prompt tokens not reused, by reason", "short", (
            Query("sum by (reason) (rate(kvnotes_reuse_miss_total[5m]))", "{{reason}}"),
        ), "Prompt tokens computed although prompt matching ran: unmatched (nothing held), policy (a "
           "matched chunk the policy recomputes), edit_declined, span_evicted, store_unavailable.", stacked=True),
        Panel("Tier hit rate per tier", "percentunit", (
            Query("sum by (tier) (rate(kvnotes_tier_hits_total[5m])) "
                  "/ sum by (tier) (rate(kvnotes_tier_lookups_total[5m]))", "{{tier}}"),
        ), "KV tier hits over lookups, plan-time misses included."),
        Panel("Requests per plan kind", "reqps", (
            Query("sum by (plan) (rate(kvnotes_requests_total[5m]))", "{{plan}}"),
        ), "Requests per second by the plan kind that executed.", stacked=True),
    )),
    Row("Data plane", (
        Panel("KV transfer throughput per transport", "Bps", (
            Query("sum by (transport) (rate(kvnotes_kv_transfer_bytes_total[5m]))", "{{transport}}"),
        ), "KV bytes moved prefill -> decode per second, summed over workers (shown in GB/s at "
           "scale)."),
        Panel("Stage time p50 by stage", "s", (
            Query(_q(0.5, "kvnotes_stage_seconds", "stage"), "{{stage}}"),
        ), "Median seconds per request in each stage of the KV path (tier get, re-rotate, "
           "forward, serialise, transfer, receive, load, first token)."),
    )),
    Row("Health", (
        Panel("Workers alive by role", "short", (
            Query("max by (role) (kvnotes_workers_alive)", "{{role}}"),
        ), "Live workers per role (every router replica reports the count: max across them). "
           "Alert KvnotesNoLiveWorker fires when a role has none."),
        Panel("Retries by role and reason", "ops", (
            Query("sum by (role, reason) (rate(kvnotes_retries_total[5m]))", "{{role}} {{reason}}"),
        ), "Retries per second against each worker role, by reason."),
        Panel("Fallbacks by reason", "ops", (
            Query("sum by (reason) (rate(kvnotes_fallbacks_total[5m]))", "{{reason}}"),
        ), "Fallbacks per second by reason (each one is also logged once)."),
        Panel("Requests by status", "reqps", (
            Query("sum by (status) (rate(kvnotes_requests_total[5m]))", "{{status}}"),
        ), "Requests per second by final status: 2xx, 4xx by reason, 5xx, cancelled, deadline.",
            stacked=True),
        Panel("Requests by outcome", "reqps", (
            Query("sum by (outcome) (rate(kvnotes_requests_total[5m]))", "{{outcome}}"),
        ), "Requests per second by outcome, every request once: ok, error, rejected (the caller's mistake), "
           "shed (refused at admission), timed_out (deadline), cancelled before / after the first token "
           "(the client left).", stacked=True),
        Panel("Requests shed by reason", "reqps", (
            Query("sum by (reason) (rate(kvnotes_shed_total[5m]))", "{{reason}}"),
            Query("sum by (result) (rate(kvnotes_admission_exchanges_total{result!=\"ok\"}[5m]))",
                  "exchange {{result}}: last heard queues decided"),
        ), "Generation requests refused at admission before any work: tenant_over_share (429), queue_full, "
           "deadline and ttft_objective (503), each with Retry-After. Alert KvnotesShedding fires above 10% "
           "of requests. The exchange lines: admissions that could not check the other replicas' queues as "
           "they are now (timeout, error, unavailable) and decided on the queues last heard."),
        Panel("Admission queue and predicted wait", "short", (
            Query("sum(kvnotes_admission_queue_depth)", "queued (all replicas)"),
            Query("max(kvnotes_admission_predicted_wait_seconds)", "predicted wait s (worst replica)"),
            Query("max(kvnotes_admission_service_interval_seconds)", "s between first tokens (worst replica)"),
            Query("min(kvnotes_admission_ttft_budget_seconds)", "TTFT objective s (tightest replica; 0: off)"),
            Query("max(kvnotes_admission_slowdown)", "slowdown vs idle (worst replica)"),
            Query("max(kvnotes_admission_peer_queued)", "other replicas' queues as heard"),
            Query("histogram_quantile(0.99, sum by (le) (rate(kvnotes_admission_exchange_seconds_bucket[5m])))",
                  "admission exchange p99 s"),
        ), "Requests admitted and not yet at their first token, the predicted queue wait of the next one "
           "(compare max_queue_wait_s), the measured service interval it rests on, the TTFT objective "
           "(admission_ttft_factor x the unloaded TTFT p90; 0 while off), the measured slowdown its model "
           "applies, the other replicas' queued requests it adds (heard through the prefill workers) and how "
           "long checking them at admission takes (p99)."),
        Panel("Remote KV tier up", "short", (
            Query("min(kvnotes_tier_remote_up)", "remote tier up"),
        ), "1 when every process reaches the remote KV tier, 0 when any cannot.", kind="stat"),
        Panel("RoPE re-rotation self-test", "short", (
            Query("min by (worker) (kvnotes_rope_selftest_ok)", "{{worker}}"),
        ), "1 when a worker's RoPE re-rotation self-test passed at start-up.", kind="stat"),
    )),
    Row("Fidelity (sampled shadow recomputes)", (
        Panel("Shadow-check agreement by operation", "percentunit", (
            Query("sum by (op, metric) (rate(kvnotes_fidelity_agree_total[30m])) "
                  "/ on (op) group_left () sum by (op) (rate(kvnotes_fidelity_kl_count[30m]))",
                  "{{op}} {{metric}}"),
        ), "Share of shadow checks whose output agreed with a full recompute, per KV operation "
           "and agreement metric (checks = observations of kvnotes_fidelity_kl). Operations: "
           "reposition(seam=..,r=..[,probe=..]) (a chunk moved after other text, r of its tokens "
           "recomputed, picked by the probe) and reuse(frame) (the first chunk after the chat frame, "
           "its variant compiled after that frame: claimed exact, so anything under 100% is a bug)."),
        Panel("Shadow checks per operation (last hour)", "short", (
            Query("sum by (op) (increase(kvnotes_fidelity_kl_count[1h]))", "{{op}}"),
        ), "How many shadow checks each operation's agreement rests on (sample counts, last hour)."),
        Panel("Exact operations: disagreements with recompute (last hour)", "short", (
            Query("sum by (op) (increase(kvnotes_fidelity_exact_mismatch_total[1h]))", "{{op}}"),
        ), "Shadow checks of an operation claimed exact (reuse(frame)) whose next token or greedy "
           "continuation differed from a full recompute: must stay 0; above it, alert "
           "KvnotesExactOperationDisagreed fires and the router logs each case at ERROR."),
        Panel("Shadow-check KL p50 / p90 by operation", "short", (
            Query(_q(0.5, "kvnotes_fidelity_kl", "op", "30m"), "p50 {{op}}"),
            Query(_q(0.9, "kvnotes_fidelity_kl", "op", "30m"), "p90 {{op}}"),
        ), "KL(recompute || operation) of the next-token distribution, nats."),
        Panel("Shadow checks per second by operation", "ops", (
            Query("sum by (op) (rate(kvnotes_fidelity_kl_count[30m]))", "{{op}}"),
        ), "How many sampled shadow recomputes the agreement and KL panels rest on."),
    )),
    Row("vLLM decode engine", (
        Panel("vLLM TTFT p50 / p90", "s", (
            Query(_q(0.5, "vllm:time_to_first_token_seconds", "model_name"), "p50 {{model_name}}"),
            Query(_q(0.9, "vllm:time_to_first_token_seconds", "model_name"), "p90 {{model_name}}"),
        ), "vLLM's own time to first token, measured inside the decode actors' engines."),
        Panel("vLLM prefix cache tokens", "short", (
            Query("sum(rate(vllm:prefix_cache_queries_total[5m]))", "queried"),
            Query("sum(rate(vllm:prefix_cache_hits_total[5m]))", "hit in vLLM's cache"),
            Query("sum(rate(vllm:external_prefix_cache_hits_total[5m]))", "hit via kvnotes connector"),
        ), "Prompt tokens per second looked up in vLLM's prefix cache, found there, and found "
           "by the kvnotes KV connector (composed KV pushed by prefill)."),
        Panel("vLLM prefix-cache hit share", "percentunit", (
            Query("sum(rate(vllm:prefix_cache_hits_total[5m])) "
                  "/ sum(rate(vllm:prefix_cache_queries_total[5m]))", "vLLM's cache"),
            Query("sum(rate(vllm:external_prefix_cache_hits_total[5m])) "
                  "/ sum(rate(vllm:prefix_cache_queries_total[5m]))", "kvnotes connector"),
        ), "Share of queried prompt tokens served by vLLM's own prefix cache and by the kvnotes "
           "connector."),
    )),
    Row("Ray Serve (router ingress)", (
        Panel("HTTP requests per second by route and status", "reqps", (
            Query('sum by (route, status_code) (rate(ray_serve_num_http_requests_total{application="kvnotes"}[5m]))',
                  "{{route}} {{status_code}}"),
        ), "Requests Serve's HTTP proxy handed to the kvnotes router, by route and HTTP status (Ray's "
           "own series, from each node's metrics agent)."),
        Panel("HTTP request latency p50 / p90 (proxy)", "ms", (
            Query(_q(0.5, "ray_serve_http_request_latency_ms", "", match='{application="kvnotes"}'), "p50"),
            Query(_q(0.9, "ray_serve_http_request_latency_ms", "", match='{application="kvnotes"}'), "p90"),
        ), "Whole-request latency measured by Serve's proxy (streams: until the last byte)."),
        Panel("Requests in flight per router replica", "short", (
            Query('sum by (replica) (ray_serve_replica_processing_queries{deployment="kvnotes-router"})',
                  "{{replica}}"),
        ), "Requests each stateless router replica is handling now (Serve's gauge)."),
    )),
)


def dashboard() -> dict:
    """The dashboard as Grafana JSON (a dict), built by grafana-foundation-sdk."""
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    source = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    dashed = [dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]

    def panel(p: Panel, panel_id: int):
        if p.kind == "stat":
            b = (stat.Panel().graph_mode(cm.BigValueGraphMode.NONE).color_mode(cm.BigValueColorMode.BACKGROUND)
                 .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps([
                     dm.Threshold(value=None, color="red"), dm.Threshold(value=1, color="green")]))
                 .span(6))
        else:
            b = (timeseries.Panel().span(12).fill_opacity(10 if p.stacked else 0)
                 .legend(cb.VizLegendOptions().show_legend(True).placement(cm.LegendPlacement.BOTTOM)
                         .display_mode(cm.LegendDisplayMode.LIST)))
            if p.stacked:
                b = b.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
            if p.dash_recompute:
                b = b.override_by_regexp(".*recompute.*", dashed)
        b = b.id(panel_id).title(p.title).description(p.description).unit(p.unit).datasource(source).height(8)
        for i, q in enumerate(p.queries):
            b = b.with_target(prometheus.Dataquery().ref_id(chr(ord("A") + i)).expr(q.expr)
                              .legend_format(q.legend).datasource(source))
        return b

    board = (db.Dashboard("kvnotes").uid("kvnotes-overview").tags(["kvnotes"]).editable()
             .description("kvnotes serving: latency, reuse, data plane, health, fidelity, vLLM engine. "
                          "Generated by python -m cluster.operator.dashboard; do not edit by hand.")
             .time("now-1h", "now").refresh("10s").timezone("browser").version(1)
             .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        board = board.with_row(db.Row(row.title).id(panel_id).collapsed(False))  # panels follow it
        for p in row.panels:
            panel_id += 1
            board = board.with_panel(panel(p, panel_id))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel in a dashboard's JSON, rows opened."""
    out = []
    for item in board.get("panels", []):
        for p in [item, *item.get("panels", [])]:
            for t in p.get("targets", []):
                out.append((p["title"], t.get("expr", "")))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cluster.operator.dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DASHBOARD_JSON), help="file to write, '-' for stdout")
    args = ap.parse_args(argv)
    text = json.dumps(dashboard(), indent=2) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
