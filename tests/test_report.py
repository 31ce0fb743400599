"""``kvnotes report`` against a real Prometheus (Debian's) that scrapes real kvnotes series: every
dashboard row becomes a PNG, index.md says which panels had data, and bad input is one line."""
import subprocess
import sys
import time

import pytest

from cluster.operator.dashboard import ROWS
from tests.conftest import free_port, prom_query, prometheus_server

@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """kvnotes' Metrics registry served over HTTP, scraped every second by a real Prometheus."""
    from prometheus_client import start_http_server

    from cluster.control.metrics import Metrics

    m = Metrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    conf = ("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvnotes\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
    with prometheus_server(conf, tmp_path_factory.mktemp("prom")) as base:
        try:
            deadline = time.monotonic() + 90
            fed = 0
            while True:
                # a workload's worth of series: two plan kinds, prompt sources, a fallback
                m.count_request("reposition", "ok")
                m.count_request("reposition", "ok")
                m.count_request("recompute", "ok")
                m.ttft.labels("reposition").observe(0.2)
                m.ttft.labels("recompute").observe(1.5)
                m.prompt_tokens.labels("repositioned").inc(900)
                m.prompt_tokens.labels("computed").inc(120)
                m.record_fallback("kv_transfer_timeout")
                # shadow checks: frame-variant reuse agrees; a probe op agrees on top-1 only
                for op, greedy in (("reuse(frame)", 1), ("reposition(seam=1,r=0.1,probe=qlast)", 0)):
                    m.fidelity_kl.labels("reuse" if greedy else "reposition", op).observe(0.01)
                    m.fidelity_agree.labels(op, "top1").inc(1)
                    m.fidelity_agree.labels(op, "greedy16").inc(greedy)
                fed += 1
                if prom_query(base, "sum(rate(kvnotes_requests_total[5m]))"):
                    break
                assert time.monotonic() < deadline, "prometheus never had two scrapes of the target"
                time.sleep(0.5)
            # the last iteration's series scraped too: the report's counts are all of them
            while not [x for x in prom_query(base, 'sum(kvnotes_fidelity_kl_count{op="reuse(frame)"})')
                       if float(x["value"][1]) == fed]:
                assert time.monotonic() < deadline + 30, "prometheus never scraped the last shadow checks"
                time.sleep(0.5)
            yield base, fed
        finally:
            server.shutdown()


def _kvnotes(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "cluster.operator.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_report_renders_every_row_and_lists_empty_panels(scraped, tmp_path):
    scraped, fed = scraped
    out = tmp_path / "report"
    r = _kvnotes("report", "--prometheus", scraped, "--out", str(out), "--since", "5m", "--step", "2s")
    assert r.returncode == 0, r.stderr[-3000:]
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == len(ROWS)
    for p in pngs:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    index = (out / "index.md").read_text()
    panels_md, ops_md = index.split("## Shadow checks by operation")
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in panels_md.splitlines() if line.startswith("| ") and not line.startswith("| panel")}
    assert len(rows) == sum(len(r.panels) for r in ROWS)
    # fed above: these panels have data; nothing fed the vLLM engine
    for title in ("Requests per plan kind", "Prompt tokens by source", "Fallbacks by reason",
                  "TTFT p50 / p90 by executed plan", "TTFT p50: speed-up over recompute",
                  "Shadow-check agreement by operation", "Shadow checks per operation (last hour)",
                  "Exact operations: disagreements with recompute (last hour)"):
        assert rows[title] == "yes", (title, index)
    assert rows["vLLM TTFT p50 / p90"] == "no data", index
    assert "panels have data" in r.stdout and "no data: vLLM TTFT p50 / p90" in r.stdout
    # the per-operation table: every check fed (all inside the 5-minute range), exact counts
    ops = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:6]]
           for line in ops_md.splitlines() if line.startswith("| ") and not line.startswith("| operation")}
    assert ops == {"reuse(frame)": [str(fed), "100.0%", "100.0%", "0"],
                   "reposition(seam=1,r=0.1,probe=qlast)": [str(fed), "100.0%", "0.0%", "n/a"]}, ops_md
    assert f"shadow reuse(frame): {fed} checks, top-1 100.0%, greedy-16 100.0%, 0 exact mismatches" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--prometheus", "http://127.0.0.1:{dead}", "--out", "{tmp}"], "cannot reach Prometheus"),
    (["--prometheus", "not-a-url", "--out", "{tmp}"], "must be an http(s) URL"),
    (["--prometheus", "{prom}", "--out", "{tmp}", "--since", "ten minutes"], "bad duration"),
])
def test_report_bad_input_is_one_line(scraped, tmp_path, args, needle):
    args = [a.format(dead=free_port(), tmp=tmp_path / "r", prom=scraped[0]) for a in args]
    r = _kvnotes("report", *args, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()
