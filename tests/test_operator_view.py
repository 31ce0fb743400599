"""What an operator sees, against a running cluster: Debian's Prometheus loads deploy/prometheus.yml
(its alert rules included) and scrapes the router while a workload runs every plan kind and one
failure; then every dashboard panel's query is asked through Prometheus' HTTP API, ``kvnotes report``
renders the panels, and the admin CLI (status, skills add/list/rm) works through the HTTP API."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest

from cluster.operator.dashboard import dashboard, panel_queries
from tests.conftest import cluster_port, free_port, metric, prom_query, prometheus_server, sd_prometheus_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

SKILLS = {
    "returns": "Returns: unused items within 30 days of delivery get a full refund. Opened electronics within 14 "
               "days, minus a 15 percent restocking fee.",
    "shipping": "Shipping: standard delivery takes 3 to 5 working days; express takes 1 day and costs 9 euros.",
}
TEMPLATE = "Booking 88231 for {passenger}. Flight LX318 status: {status}. Gate {gate}.\n"

# Panels this cluster cannot feed, each with the reason. The test fails when one of them gets data
# (shrink the list) or when any other panel has none.
NOT_YET = {   # the vLLM row needs decode_engine: vllm: tests/test_e2e_vllm_cluster.py proves those queries
    "vLLM TTFT p50 / p90": "decode_engine: vllm (this cluster runs the reference engine)",
    "vLLM prefix cache tokens": "decode_engine: vllm",
    "vLLM prefix-cache hit share": "decode_engine: vllm",
}


TIER: dict = {}       # the lm:// tier server of the module's cluster (the workload restarts it)


def _auth(cfg) -> dict:
    key_file = Path(cfg.state.data_dir) / "api_key"
    return {"authorization": f"Bearer {key_file.read_text().strip()}"} if key_file.exists() else {}


def _cli(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "cluster.operator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, local_ray):
    from cluster.control.ray_backends import tier_key_of
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig
    from kvtransport.tier.server import start_tier_server, stop_tier_server

    root = tmp_path_factory.mktemp("operator")
    tier_port = free_port()
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=256 << 20, data_dir=str(root / "state"),
                        tier_remote_url=f"lm://127.0.0.1:{tier_port}",
                        shadow_fraction=1.0,          # every approximate request gets a shadow check
                        metrics_tenants=("default",))  # the embedded key's tenant gets its own label
    # a shared lm:// tier, as deployed: its key derived from the cluster secret, like the actors'
    TIER["key"] = tier_key_of(cfg)
    TIER["server"] = start_tier_server("127.0.0.1", tier_port, key=TIER["key"], log_path=root / "tier.log")
    try:
        start(cfg, local_cpus=4)
        try:
            yield cfg, f"http://127.0.0.1:{cfg.server.port}"
        finally:
            stop(cfg)
    finally:
        stop_tier_server(TIER["server"])


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """deploy/prometheus.yml as shipped (rule files included), discovering this cluster's processes
    through the router, 1 s scrapes."""
    cfg, base = cluster
    with prometheus_server(sd_prometheus_config(base), tmp_path_factory.mktemp("prometheus"),
                           {"alerts.yml": ROOT / "deploy" / "alerts.yml"}) as url:
        # every process discovered and scraped: the router replica, the prefill and the decode actor,
        # the Ray node's metrics agent
        deadline = time.monotonic() + 60
        while len(_query(url, 'up{job="kvnotes"} == 1')) < 4:
            assert time.monotonic() < deadline, f"prometheus did not scrape every process: {_query(url, 'up')}"
            time.sleep(0.5)
        yield url


def _query(url: str, expr: str):
    return prom_query(url, expr)


@pytest.fixture(scope="module")
def workload(cluster, prometheus, tmp_path_factory):
    """Skills added by the admin CLI, then every plan kind and one failure over HTTP."""
    cfg, base = cluster
    d = tmp_path_factory.mktemp("skills")
    for name, text in SKILLS.items():
        (d / f"{name}.txt").write_text(text)
    key = _auth(cfg).get("authorization", " ").split(" ", 1)[1]
    added = _cli("skills", "add", str(d), "--url", base, *(["--key", key] if key else []))
    assert added.returncode == 0, added.stderr[-2000:]
    h = _auth(cfg)
    with httpx.Client(base_url=base, timeout=300, headers=h) as c:
        r = c.post("/v1/templates", json={"name": "booking", "text": TEMPLATE})
        assert r.status_code == 201, r.text
        q = {"text": "Can I return opened headphones after 10 days? Answer yes or no."}
        kinds = set()
        # the default policy (none named) with the skill right after the chat frame: exact reuse of
        # its frame variant, shadow-checked live (shadow_fraction 1.0) under reuse(frame); waited for
        # before anything else runs, so the check is this request's
        r = c.post("/v1/notes/completions", json={"segments": [{"skill": "returns"}, q], "max_tokens": 4,
                                                  "temperature": 0, "explain": True})
        assert r.status_code == 200, r.text
        steps = r.json()["explain"]["steps"]
        assert r.json()["plan"] == "reuse" and any(s["source"] == "frame+skill:returns" and s["kind"] == "reuse"
                                                   for s in steps), steps
        kinds.add(r.json()["plan"])
        deadline = time.monotonic() + 300
        while metric(c.get("/metrics").text, "kvnotes_fidelity_checks_total", op="reuse(frame)") < 1:
            assert time.monotonic() < deadline, "the frame-variant request's shadow check never finished"
            time.sleep(1)
        for policy in ("fast", "exact"):              # reposition (the 2nd skill), then exact reuse + recompute
            r = c.post("/v1/notes/completions", json={"segments": [{"skill": "returns"}, {"skill": "shipping"}, q],
                                                      "max_tokens": 4, "temperature": 0, "kv_policy": policy,
                                                      "explain": True})
            assert r.status_code == 200, r.text
            kinds.add(r.json()["plan"])
        for status in ("ON TIME", "DELAYED"):         # a session turn, then an erratum / edit-in-place
            r = c.post("/v1/notes/completions", json={
                "session": "s1", "kv_policy": "fast", "max_tokens": 4, "temperature": 0, "explain": True,
                "segments": [{"template": "booking", "fields": {"passenger": "Ada Byron", "status": status,
                                                                 "gate": "B12"}}, {"text": "Status?"}]})
            assert r.status_code == 200, r.text
            kinds.add(r.json()["plan"])
        # the one failure: the remote tier goes down while the session's context has left the
        # prefill actor's local tier (as an LRU eviction would); the next turn must notice at plan
        # time, count a fallback and plan from scratch. Then the remote tier comes back.
        import ray

        from kvtransport.tier.server import start_tier_server, stop_tier_server
        old = TIER["server"]
        stop_tier_server(old)

        from cluster.control.sessions import SessionStore
        from cluster.control.state import StoreLimits, open_state
        state = open_state(cfg.state.resolved_url, StoreLimits(cfg.state.session_ttl_s, cfg.state.session_max,
                                                               cfg.state.prompt_index_ttl_s, cfg.state.prompt_index_max))
        ctx = SessionStore(state).get(cfg.server.tenant, "s1").context
        assert any(ray.get([ray.get_actor(f"prefill-{i}", namespace="kvnotes").evict.remote(ctx)
                            for i in range(cfg.workers.prefill.count)]))
        r = c.post("/v1/notes/completions", json={
            "session": "s1", "kv_policy": "fast", "max_tokens": 4, "temperature": 0, "explain": True,
            "segments": [{"template": "booking", "fields": {"passenger": "Ada Byron", "status": "CANCELLED",
                                                             "gate": "B12"}}, {"text": "Status?"}]})
        assert r.status_code == 200, r.text
        assert metric(c.get("/metrics").text, "kvnotes_fallbacks_total", reason="session_context_evicted") == 1
        TIER["server"] = start_tier_server(old.host, old.port, key=TIER["key"], log_path=old.log_path)
        prompt = "The three primary colours of light are red, green and blue. " * 24 + "Name one:"
        for _ in range(2):                            # stored, then reused
            r = c.post("/v1/completions", json={"model": cfg.workers.model, "prompt": prompt, "max_tokens": 3,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
        r = c.post("/v1/notes/completions", json={"segments": [{"skill": "no-such-skill"}], "max_tokens": 2})
        assert r.status_code == 404, r.text           # a client error before any plan
        if h:
            assert httpx.get(f"{base}/v1/skills", timeout=30).status_code == 401    # no key
        # a client that leaves mid-stream: counted as cancelled, with the plan it had
        with c.stream("POST", "/v1/notes/completions", json={
                "segments": [{"skill": "shipping"}, {"skill": "returns"}, q], "max_tokens": 48, "temperature": 0,
                "stream": True,
                "kv_policy": "fast"}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {") and '"token"' in line:
                    break                                   # first token seen: hang up
    # shadow checks run after the responses, on the prefill actor: wait for their results
    deadline = time.monotonic() + 300
    while metric(httpx.get(f"{base}/metrics", timeout=30).text, "kvnotes_fidelity_kl_count") < 1:
        assert time.monotonic() < deadline, "no shadow check finished"
        time.sleep(1)
    # two scrapes after the last result, so rate() windows hold the whole workload
    time.sleep(3)
    return kinds


def test_every_request_is_counted_once_with_its_final_status(cluster, workload):
    cfg, base = cluster
    h = _auth(cfg)
    deadline = time.monotonic() + 60
    while True:                       # the cancelled stream is counted when the router notices the hang-up
        text = httpx.get(f"{base}/metrics", timeout=30).text
        if metric(text, "kvnotes_requests_total", status="cancelled") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert metric(text, "kvnotes_requests_total", plan="reposition", status="cancelled") == 1
    assert metric(text, "kvnotes_requests_total", plan="none", status="not_found") == 1
    if h:
        assert metric(text, "kvnotes_requests_total", plan="none", status="unauthorized", tenant="none") >= 1
    assert metric(text, "kvnotes_requests_total", status="ok", tenant="other") == 0    # one tenant, labelled
    # 3 compose, 3 session turns, 2 prompts: ok; registrations and the template: ok with plan "none"
    ok_planned = sum(metric(text, "kvnotes_requests_total", plan=p, status="ok", tenant=cfg.server.tenant)
                     for p in ("reuse", "reposition", "recompute", "erratum", "edit_in_place"))
    assert ok_planned == 8, text
    assert metric(text, "kvnotes_requests_total", plan="none", status="ok") >= 3


def test_workload_ran_every_plan_kind(workload):
    assert {"reposition", "recompute"} <= workload and workload & {"erratum", "edit_in_place"}, workload


def test_every_panel_query_returns_series(prometheus, workload):
    empty = []
    for title, expr in panel_queries(dashboard()):
        if not _query(prometheus, expr):
            empty.append(title)
    unexpected = sorted(set(empty) - set(NOT_YET))
    assert not unexpected, f"panels with no series: {unexpected}"
    grown = sorted(set(NOT_YET) - set(empty))
    assert not grown, f"these panels have data now; remove them from NOT_YET: {grown}"


def test_every_process_is_discovered_and_exports_its_own_series(cluster, prometheus, workload):
    cfg, base = cluster
    groups = httpx.get(f"{base}/metrics/targets", timeout=30).json()
    roles = sorted(g["labels"]["kvnotes_role"] for g in groups)
    assert roles == ["decode", "prefill", "ray", "router"], groups     # ray: the node's metrics agent (Serve)
    up = {r["metric"]["kvnotes_process"]: r["value"][1] for r in _query(prometheus, 'up{job="kvnotes"}')}
    assert set(up) == {g["labels"]["kvnotes_process"] for g in groups} >= {"prefill-0", "decode-0"}
    assert set(up.values()) == {"1"}, up
    # series only a worker has: the prefill actor's tier traffic, the decode actor's inbox
    put = _query(prometheus, 'sum(kvnotes_worker_tier_bytes_total{direction="put", kvnotes_role="prefill"})')
    assert put and float(put[0]["value"][1]) > 0, put
    assert _query(prometheus, 'kvnotes_inbox_held_bytes{kvnotes_role="decode"}')
    regs = _query(prometheus, 'kvnotes_registered_chunks{kind="skill", in_tier="true"}')
    assert regs and float(regs[0]["value"][1]) == len(SKILLS), regs     # both skills, as last looked up
    held = _query(prometheus, 'sum(kvnotes_tier_bytes{kvnotes_role="prefill", tier="cpu"})')
    assert held and float(held[0]["value"][1]) > 0, held          # the skills' KV, in bytes
    # the router's request counter is summed from the replica's own endpoint (no double count)
    reqs = _query(prometheus, 'sum(kvnotes_requests_total{kvnotes_role="router"})')
    assert float(reqs[0]["value"][1]) == float(_query(prometheus, "sum(kvnotes_requests_total)")[0]["value"][1])


def test_alert_rules_are_loaded_and_evaluated(prometheus, workload):
    with urllib.request.urlopen(prometheus + "/api/v1/rules", timeout=10) as r:
        groups = json.loads(r.read())["data"]["groups"]
    rules = {rule["name"]: rule for g in groups for rule in g["rules"]}
    assert len(rules) == 9 and all(rule["health"] in ("ok", "unknown") for rule in rules.values()), rules
    assert rules["KvnotesStateStoreDown"]["state"] == "inactive"      # the store answered throughout
    assert rules["KvnotesExactOperationDisagreed"]["state"] == "inactive"   # frame variants agreed
    assert {s["value"][1] for s in _query(prometheus, "kvnotes_state_store_up")} == {"1"}


def test_report_from_the_live_prometheus(prometheus, workload, tmp_path):
    r = _cli("report", "--prometheus", prometheus, "--out", str(tmp_path / "report"), "--since", "90s")
    assert r.returncode == 0, r.stderr[-2000:]
    index = (tmp_path / "report" / "index.md").read_text()
    assert "| Requests per plan kind | yes |" in index and "| Tier hit rate per tier | yes |" in index, index
    assert re.search(r"^\| reuse\(frame\) \| [1-9]\d* \| 100\.0% \| 100\.0% \| 0 \|$", index, re.M), index
    assert re.search(r"shadow reuse\(frame\): [1-9]\d* checks, top-1 100\.0%", r.stdout), r.stdout


def test_admin_cli_lists_status_and_removes(cluster, workload):
    cfg, base = cluster
    key = _auth(cfg).get("authorization", " ").split(" ", 1)[1]
    auth = ["--url", base, *(["--key", key] if key else [])]
    listed = _cli("skills", "list", *auth)
    assert listed.returncode == 0, listed.stderr
    lines = {ln.split()[0]: ln for ln in listed.stdout.splitlines() if ln and not ln.endswith(" skills")}
    assert set(SKILLS) <= set(lines) and all("in tier" in lines[n] for n in SKILLS), listed.stdout
    st = _cli("status", *auth)
    assert st.returncode == 0, st.stdout + st.stderr
    assert "skills   2 registered, 2 in the tier" in st.stdout and "state    " in st.stdout, st.stdout
    assert "workers  prefill: 1/1 alive" in st.stdout and "workers  decode: 1/1 alive" in st.stdout, st.stdout
    assert re.search(r"remote=(up|DOWN)", st.stdout) and re.search(r"prefill-0\s+cpu=\d+\.\d MiB", st.stdout), st.stdout
    rm = _cli("skills", "rm", "shipping", *auth)
    assert rm.returncode == 0 and "shipping: deleted" in rm.stdout, rm.stdout + rm.stderr
    after = _cli("skills", "list", *auth)
    assert "shipping" not in after.stdout and "returns" in after.stdout
    missing = _cli("skills", "rm", "shipping", *auth)
    assert missing.returncode == 2 and "HTTP 404" in missing.stderr and "Traceback" not in missing.stderr
    bad = _cli("skills", "add", "/no/such/dir", *auth)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no such file" in bad.stderr


def test_health_shows_the_fidelity_view(cluster, workload):
    """Shadow checks ran on the approximate requests: /health details carry each operation's
    window (samples, agreement, demotion) and what each policy composes with, and why."""
    cfg, base = cluster
    h = httpx.get(f"{base}/health", headers=_auth(cfg), timeout=30).json()
    fid = h["fidelity"]
    assert fid["shadow_fraction"] == 1.0 and set(fid["compose"]) >= {"balanced"}
    assert fid["operations"] and all(o["samples"] >= 1 and o["demoted"] in (True, False)
                                     for o in fid["operations"].values()), fid


def test_frame_variant_agreement_is_live_in_prometheus_and_health(cluster, prometheus, workload):
    """The default policy's frame-variant reuse, shadow-checked: booked under reuse(frame) with
    agreement 1.0 on both metrics, no exactness mismatch, as the dashboard's own queries read it
    from the real Prometheus, and in /health's fidelity view with its sample count."""
    from cluster.operator.dashboard import ROWS
    cfg, base = cluster
    panels = {p.title: p for r in ROWS for p in r.panels}
    agree = {(s["metric"]["op"], s["metric"]["metric"]): float(s["value"][1])
             for s in _query(prometheus, panels["Shadow-check agreement by operation"].queries[0].expr)}
    assert agree[("reuse(frame)", "top1")] == 1.0 and agree[("reuse(frame)", "greedy16")] == 1.0, agree
    counts = {s["metric"]["op"]: float(s["value"][1])
              for s in _query(prometheus, panels["Shadow checks per operation (last hour)"].queries[0].expr)}
    assert counts["reuse(frame)"] > 0, counts
    mism = _query(prometheus, panels["Exact operations: disagreements with recompute (last hour)"].queries[0].expr)
    assert [(s["metric"]["op"], float(s["value"][1])) for s in mism] == [("reuse(frame)", 0.0)], mism
    op = httpx.get(f"{base}/health", headers=_auth(cfg), timeout=30).json()["fidelity"]["operations"]["reuse(frame)"]
    assert op["samples"] >= 1 and op["top1"] == 1.0 and op["greedy_exact"] == 1.0, op
    assert op["exact"] and op["mismatches"] == 0 and not op["demoted"], op
