"""bench.pd_servers' proxy and parsing, without vLLM: the request bodies, the Prometheus deltas and
the two-leg flow against a stand-in HTTP server (the real two-server run is ``python -m
bench.vllm_pd``, minutes long, not in CI)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.pd_servers import (PDServers, decode_body, kv_transfer_config, pd_request, prefill_body,
                              prometheus_sums, server_command, server_env, sse_events)

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-1",
          "remote_block_ids": [[3, 4, 5]], "remote_request_id": "r1", "remote_host": "127.0.0.1",
          "remote_port": 5600, "tp_size": 1}


def test_bodies_and_server_command():
    p = prefill_body("m", [1, 2, 3], "salt")
    assert p["max_tokens"] == 1 and p["kv_transfer_params"]["do_remote_decode"] is True and p["prompt"] == [1, 2, 3]
    d = decode_body("m", [1, 2, 3], PARAMS, 4, "salt")
    assert d["kv_transfer_params"] is PARAMS and d["stream"] and d["max_tokens"] == 4 and d["cache_salt"] == "salt"
    with pytest.raises(ValueError, match="kv_transfer_params"):
        decode_body("m", [1], None, 4, "s")
    with pytest.raises(ValueError, match="kv_transfer_params"):
        decode_body("m", [1], {"do_remote_prefill": False}, 4, "s")
    cfg = json.loads(kv_transfer_config("kv_consumer"))
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    with pytest.raises(ValueError):
        kv_transfer_config("kv_both")
    cmd = server_command("py", "/ckpt", "m", 8100, "kv_producer", "float32", 8192)
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"] == "kv_producer"
    env = server_env({"PATH": "/bin"}, 5601, 2, 1)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601" and env["PATH"] == "/bin"


def test_prometheus_sums_add_label_sets_and_skip_others():
    text = ("# HELP vllm:nixl_bytes_transferred x\n"
            'vllm:nixl_bytes_transferred_sum{engine="0",model_name="a b"} 1.5e6\n'
            'vllm:nixl_bytes_transferred_sum{engine="1",model_name="a"} 5e5\n'
            'vllm:nixl_bytes_transferred_bucket{le="1.0"} 9\n'
            "vllm:nixl_xfer_time_seconds_count 3\n")
    s = prometheus_sums(text)
    assert s["vllm:nixl_bytes_transferred_sum"] == 2e6 and s["vllm:nixl_xfer_time_seconds_count"] == 3
    assert s["vllm:nixl_xfer_time_seconds_sum"] == 0.0
    with pytest.raises(ValueError, match="unparsable"):
        prometheus_sums("vllm:nixl_xfer_time_seconds_sum abc\n")


def test_sse_events_stop_at_done():
    lines = ['data: {"a": 1}', "", ": keep-alive", 'data: {"a": 2}', "data: [DONE]", 'data: {"a": 3}']
    assert [e["a"] for e in sse_events(lines)] == [1, 2]


class _Fake(BaseHTTPRequestHandler):
    """Producer and consumer in one: /v1/completions answers by the body's kv_transfer_params."""
    seen: list[dict] = []
    pulls = 0

    def log_message(self, *a):
        pass

    def do_GET(self):
        n = type(self).pulls
        body = (f"vllm:nixl_bytes_transferred_sum{{engine=\"0\"}} {n * 1000.0}\n"
                f"vllm:nixl_xfer_time_seconds_sum {n * 0.01}\nvllm:nixl_xfer_time_seconds_count {n}\n").encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(req)
        self.send_response(200)
        self.end_headers()
        if req["kv_transfer_params"].get("do_remote_decode"):
            self.wfile.write(json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode())
            return
        type(self).pulls += 1
        for tok in (11, 12):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': 't', 'token_ids': [tok]}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_proxy_sends_the_producers_params_to_the_consumer_and_measures_the_pull():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    try:
        srv = PDServers.__new__(PDServers)           # no processes: both roles point at the stand-in
        port = httpd.server_address[1]
        srv.name = "m"
        srv.producer = srv.consumer = type("S", (), {"url": f"http://127.0.0.1:{port}"})()
        r = pd_request(srv, [5, 6, 7], 2, "salt-1")
    finally:
        httpd.shutdown()
        httpd.server_close()
    pre, dec = _Fake.seen
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["do_remote_decode"]
    assert dec["kv_transfer_params"] == PARAMS and dec["prompt"] == [5, 6, 7] and dec["cache_salt"] == "salt-1"
    assert r["tokens"] == [11, 12] and r["pull_bytes"] == 1000.0 and r["pulls"] == 1
    assert r["pull_seconds"] == pytest.approx(0.01) and 0 < r["decode_leg"] and 0 < r["prefill_leg"]


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_servers_build_nixl_agents_without_the_progress_thread(quiet):
    """The env ``--vllm-nixl quiet`` gives the vLLM servers: every nixl_agent_config built in those
    processes (vLLM's included) has the busy-polling progress thread off; shipped keeps NIXL's default."""
    import os
    import subprocess
    import sys
    env = server_env(dict(os.environ), 5601, 2, 1, quiet=quiet)
    code = "from nixl._api import nixl_agent_config as c; print(c(num_threads=4).enable_pthread)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(not quiet)
