"""kvnotes' own listeners bind the address Ray runs on (127.0.0.1 for a local cluster serving a
loopback host) or ``bind_host``, never every interface; ``metrics_auth`` puts the map of internal
endpoints (``/metrics/targets``) behind an API key. Against a real cluster."""
from __future__ import annotations

import ipaddress

import pytest

from tests.conftest import cluster_port, http_client

# one prefill and one decode actor of SmolLM2 with a 128 MiB tier, as in the other modules of this unit
# (tests/conftest.py: their actors are started once and taken over from one module's cluster to the next)
WORKERS_UNIT = "smollm2-tier128"

_KVNOTES_PROCS = ("ray::prefill", "ray::decode", "ray::PrefillWorker", "ray::DecodeWorker",
                  "ServeReplica:kvnotes:kvnotes-router")


def _listeners() -> dict[str, list[str]]:
    """Listening TCP sockets of this test's kvnotes worker processes (router replica, prefill and
    decode actors): process title -> ["ip:port", ...]."""
    import psutil
    out: dict[str, list[str]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
            if not title.startswith(_KVNOTES_PROCS) and not any(k in title for k in _KVNOTES_PROCS):
                continue
            socks = [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
        out[f"{p.pid} {title[:60]}"] = [f"{c.laddr.ip}:{c.laddr.port}" for c in socks]
    return out


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return (a.ipv4_mapped or a).is_loopback if a.version == 6 else a.is_loopback


def _ray_worker_ports() -> set[int]:
    """Ray's own listener in each actor process (its core worker's gRPC server, every interface),
    from Ray's actor table: Ray's, not kvnotes'."""
    import ray._private.state
    return {a["Address"]["Port"] for a in ray._private.state.actors().values() if a.get("Address")}


def test_bind_host_is_validated():
    from kvruntime.config import ClusterConfig
    assert ClusterConfig.of(bind_host="10.1.2.3").server.bind_host == "10.1.2.3"
    for bad in ("0.0.0.0", "::", "my-host", ""):
        with pytest.raises(ValueError, match="bind_host"):
            ClusterConfig.of(bind_host=bad)
    with pytest.raises(ValueError, match="metrics_auth"):
        ClusterConfig.of(metrics_auth=True, auth=False)
    assert ClusterConfig().local_loopback and not ClusterConfig.of(host="0.0.0.0").local_loopback


@pytest.mark.slow
def test_a_loopback_cluster_listens_on_loopback_only_and_its_targets_need_a_key(tmp_path, local_ray):
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig

    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, data_dir=str(tmp_path), metrics_auth=True)
    start(cfg, local_cpus=4)
    client = http_client(cfg, timeout=120)
    try:
        assert client.get("/health").json()["status"] == "ok"
        import httpx
        anon = httpx.get(f"http://127.0.0.1:{cfg.server.port}/metrics/targets", timeout=60)
        assert anon.status_code == 401 and anon.json()["error"]["request_id"], anon.text
        bad = httpx.get(f"http://127.0.0.1:{cfg.server.port}/metrics/targets", timeout=60,
                        headers={"authorization": "Bearer kvn-not-a-key"})
        assert bad.status_code == 401
        groups = client.get("/metrics/targets").json()
        roles = {g["labels"]["kvnotes_role"] for g in groups}
        assert {"router", "prefill", "decode"} <= roles, groups
        for g in groups:
            if g["labels"]["kvnotes_role"] == "ray":
                continue                      # Ray's own metrics agent: Ray runs on the node's address
            for t in g["targets"]:
                assert _loopback(t.rpartition(":")[0]), groups
        # a request crosses the decode inbox, so every listener is up
        assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        from tests.conftest import metric                 # NIXL (UCX kept on lo) did not fall back to gRPC
        assert metric(client.get("/metrics").text, "kvnotes_fallbacks_total", reason="kv_transport_nixl_unavailable") == 0
        found = _listeners()
        assert len(found) >= 3, found                # router replica, prefill actor, decode actor
        ray_ports = _ray_worker_ports()
        exposed = {who: [a for a in addrs if not _loopback(a.rpartition(":")[0])
                         and int(a.rpartition(":")[2]) not in ray_ports] for who, addrs in found.items()}
        for who in exposed:         # Ray Serve's own inter-deployment gRPC server in each replica ([::]:0)
            if "ServeReplica" in who and len(exposed[who]) == 1 and exposed[who][0].startswith(":::"):
                exposed[who] = []
        assert not any(exposed.values()), (exposed, found, ray_ports)
        loopback = [a for addrs in found.values() for a in addrs if _loopback(a.rpartition(":")[0])]
        assert len(loopback) >= 3, found            # the exporters and the decode inbox are there, on loopback
    finally:
        client.close()
        stop(cfg)
