"""The dashboard is the SDK-built one and every panel's query parses in a real Prometheus; the
alert rules load, are wired into deploy/prometheus.yml, and pass their promtool unit tests."""
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster.operator.dashboard import DASHBOARD_JSON, METRICS, ROWS, Panel, dashboard, panel_queries
from tests.conftest import prometheus_server

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

# Metric names in PromQL: kvnotes_* and vLLM's vllm:* (colons are legal in metric names).
_NAME = re.compile(r"(?<![\w:])(kvnotes_\w+|vllm:[\w:]+|ray_serve_\w+)")


def _base_name(name: str) -> str:
    """A histogram's series name (``x_bucket``, ``x_count``, ``x_sum``) -> ``x``."""
    stripped = re.sub(r"_(bucket|count|sum)$", "", name)
    return stripped if stripped in METRICS else name


@pytest.fixture(scope="module")
def board():
    return dashboard()


def test_committed_json_is_what_the_builder_generates(board):
    on_disk = json.loads(DASHBOARD_JSON.read_text())
    assert on_disk == board, "regenerate: python -m cluster.operator.dashboard"


def test_dashboard_is_built_by_the_sdk_not_by_hand(board):
    # Fields the SDK's Dashboard model writes that the old hand-written dict never had.
    assert board["schemaVersion"] == 36 and "fiscalYearStartMonth" in board and "graphTooltip" in board
    import grafana_foundation_sdk  # noqa: F401  (the builder needs it; the runtime does not)
    source = (ROOT / "cluster" / "operator" / "dashboard.py").read_text()
    assert not re.search(r"^(from|import) grafana_foundation_sdk", source, re.M), \
        "import the SDK inside dashboard(), not at module level"


def test_rows_and_panels(board):
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [r.title for r in ROWS]
    assert rows[:4] == ["Latency", "Reuse", "Data plane", "Health"]
    assert rows[4].startswith("Fidelity") and rows[5].startswith("vLLM") and rows[6].startswith("Ray Serve")
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) == sum(len(r.panels) for r in ROWS)
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    for p in panels:
        assert p["targets"], f"{p['title']}: no query"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["expr"].strip(), f"{p['title']}: empty query"
        # no two panels overlap on the grid
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


def test_metric_list_is_exactly_what_the_panels_query(board):
    used = {_base_name(n) for _, expr in panel_queries(board) for n in _NAME.findall(expr)}
    assert used == set(METRICS), f"only in queries: {used - set(METRICS)}; unused: {set(METRICS) - used}"
    # What the dashboard must show at least: request outcomes, latency, where prompt tokens came from,
    # tier and transfer health, stages, fallbacks and retries (kvnotes' names and vLLM's).
    asked = {"kvnotes_ttft_seconds", "kvnotes_requests_total", "kvnotes_prompt_tokens_total",
             "kvnotes_tier_hits_total", "kvnotes_tier_lookups_total", "kvnotes_kv_transfer_bytes_total",
             "kvnotes_stage_seconds", "kvnotes_fallbacks_total", "kvnotes_retries_total",
             "kvnotes_workers_alive", "kvnotes_tier_remote_up", "kvnotes_fidelity_agree_total",
             "kvnotes_fidelity_kl", "vllm:time_to_first_token_seconds", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"}
    assert asked <= set(METRICS)


def test_counters_are_summed_across_processes(board):
    """Several router replicas and workers export the same series: a panel never shows one
    process' counter on its own."""
    for title, expr in panel_queries(board):
        for m in re.finditer(r"rate\((?:kvnotes_|vllm:)", expr):
            before = expr[:m.start()].rstrip()
            assert before.endswith("(") and re.search(r"sum(\s+by\s*\([^)]*\)\s*)?\($", before), \
                f"{title}: rate() not directly inside sum by (...): {expr}"


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Debian's prometheus with no scrape targets on a free loopback port; its base URL."""
    with prometheus_server("global:\n  scrape_interval: 15s\nscrape_configs: []\n",
                           tmp_path_factory.mktemp("prometheus")) as base:
        yield base


def test_every_panel_query_parses_in_prometheus(prometheus, board):
    # The check itself: a syntax error is a 400 bad_data.
    status, body = _get(prometheus + "/api/v1/query?" + urllib.parse.urlencode(
        {"query": "sum by (plan (rate(kvnotes_requests_total[5m]))"}))
    assert status == 400 and body["errorType"] == "bad_data"
    queries = panel_queries(board)
    assert len(queries) >= 20
    for title, expr in queries:
        status, body = _get(prometheus + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert status == 200 and body["status"] == "success", f"{title}: {expr}: {status} {body}"


def _run(*args: str) -> str:
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "SUCCESS" in out and "FAILED" not in out, out
    return out


def test_promtool_check_config_loads_the_rules():
    out = _run(PROMTOOL, "check", "config", "deploy/prometheus.yml")
    assert "1 rule files found" in out and "9 rules found" in out


def test_promtool_check_rules():
    _run(PROMTOOL, "check", "rules", "deploy/alerts.yml")


def test_promtool_unit_tests_for_every_alert():
    _run(PROMTOOL, "test", "rules", "deploy/alerts_test.yml")


def _alerts() -> dict[str, dict]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_alert_rules_are_complete_and_wired():
    alerts = _alerts()
    assert set(alerts) == {"KvnotesTTFTP90High", "KvnotesFallbackRateHigh", "KvnotesRetryRateHigh",
                           "KvnotesFidelityAgreementLow", "KvnotesExactOperationDisagreed", "KvnotesNoLiveWorker",
                           "KvnotesRemoteTierDown", "KvnotesStateStoreDown", "KvnotesShedding"}
    for name, rule in alerts.items():
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    assert "kvnotes_workers_alive" in alerts["KvnotesNoLiveWorker"]["expr"]
    assert "absent(" in alerts["KvnotesNoLiveWorker"]["expr"]
    assert re.search(r"kvnotes_tier_remote_up\s*==\s*0", alerts["KvnotesRemoteTierDown"]["expr"])
    assert re.search(r"kvnotes_state_store_up\s*==\s*0", alerts["KvnotesStateStoreDown"]["expr"])
    exact = alerts["KvnotesExactOperationDisagreed"]
    assert "kvnotes_fidelity_exact_mismatch_total" in exact["expr"] and exact["labels"]["severity"] == "critical"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    fires, quiet = set(), set()
    for group in yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())["tests"]:
        for case in group["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    assert fires == quiet == set(_alerts())


def _panel(title: str) -> Panel:
    return next(p for r in ROWS for p in r.panels if p.title == title)


def test_fidelity_panels_answer_for_every_operation_key(tmp_path):
    """The fidelity panels' own queries, evaluated by promtool on series labelled with every kind
    of operation key: reuse(frame) (claimed exact), a reposition with the default probe and one
    with a question-guided probe. Each gets its own agreement, sample count and mismatch count."""
    from cluster.control.planner import compose_op_key
    from cluster.control.shadow import FRAME_REUSE_OP
    ops = {FRAME_REUSE_OP: (2, 2, 2, 0), compose_op_key(1, 0.0): (2, 1, 0, None),
           compose_op_key(1, 0.1, "qlast"): (4, 3, 2, None)}       # op: checks, top1, greedy16 per minute; mismatches
    assert set(ops) == {"reuse(frame)", "reposition(seam=1,r=0)", "reposition(seam=1,r=0.1,probe=qlast)"}
    series = []
    for op, (n, top1, greedy, mism) in ops.items():
        series += [{"series": f'kvnotes_fidelity_kl_count{{op="{op}",instance="router-1"}}', "values": f"0+{n}x120"},
                   {"series": f'kvnotes_fidelity_agree_total{{op="{op}",metric="top1"}}', "values": f"0+{top1}x120"},
                   {"series": f'kvnotes_fidelity_agree_total{{op="{op}",metric="greedy16"}}',
                    "values": f"0+{greedy}x120"}]
        if mism is not None:
            series.append({"series": f'kvnotes_fidelity_exact_mismatch_total{{op="{op}"}}', "values": "0x120"})
    agree = _panel("Shadow-check agreement by operation").queries[0].expr
    counts = _panel("Shadow checks per operation (last hour)").queries[0].expr
    mismatch = _panel("Exact operations: disagreements with recompute (last hour)").queries[0].expr
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": agree, "eval_time": "90m", "exp_samples": [
            {"labels": f'{{op="{op}",metric="{m}"}}', "value": v / n}
            for op, (n, top1, greedy, _) in ops.items() for m, v in (("top1", top1), ("greedy16", greedy))]},
        {"expr": counts, "eval_time": "90m", "exp_samples": [
            {"labels": f'{{op="{op}"}}', "value": n * 60} for op, (n, *_) in ops.items()]},
        {"expr": mismatch, "eval_time": "90m", "exp_samples": [{"labels": '{op="reuse(frame)"}', "value": 0}]},
    ]}]
    f = tmp_path / "panels_test.yml"
    f.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    _run(PROMTOOL, "test", "rules", str(f))
