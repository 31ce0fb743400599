"""``kvnotes report`` against a real Prometheus (Debian's) that scrapes real kvnotes series: every
dashboard row becomes a PNG, index.md says which panels had data, and bad input is one line."""
import subprocess
import sys
import time

import pytest

from cluster.ops.dashboard import ROWS
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
                if prom_query(base, "sum(rate(kvnotes_requests_total[5m]))"):
                    break
                assert time.monotonic() < deadline, "prometheus never had two scrapes of the target"
                time.sleep(0.5)
            yield base
        finally:
            server.shutdown()


def _kvnotes(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "cluster.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_report_renders_every_row_and_lists_empty_panels(scraped, tmp_path):
    out = tmp_path / "report"
    r = _kvnotes("report", "--prometheus", scraped, "--out", str(out), "--since", "5m", "--step", "2s")
    assert r.returncode == 0, r.stderr[-3000:]
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == len(ROWS)
    for p in pngs:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    index = (out / "index.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in index.splitlines() if line.startswith("| ") and not line.startswith("| panel")}
    assert len(rows) == sum(len(r.panels) for r in ROWS)
    # fed above: these panels have data; nothing fed the vLLM engine or shadow checks
    for title in ("Requests per plan kind", "Prompt tokens by source", "Fallbacks by reason",
                  "TTFT p50 / p90 by executed plan", "TTFT p50: speed-up over recompute"):
        assert rows[title] == "yes", (title, index)
    for title in ("vLLM TTFT p50 / p90", "Shadow-check KL p50 / p90 by operation"):
        assert rows[title] == "no data", (title, index)
    assert "panels have data" in r.stdout and "no data: vLLM TTFT p50 / p90" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--prometheus", "http://127.0.0.1:{dead}", "--out", "{tmp}"], "cannot reach Prometheus"),
    (["--prometheus", "not-a-url", "--out", "{tmp}"], "must be an http(s) URL"),
    (["--prometheus", "{prom}", "--out", "{tmp}", "--since", "ten minutes"], "bad duration"),
])
def test_report_bad_input_is_one_line(scraped, tmp_path, args, needle):
    args = [a.format(dead=free_port(), tmp=tmp_path / "r", prom=scraped) for a in args]
    r = _kvnotes("report", *args, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()
