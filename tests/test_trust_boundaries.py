"""Trust boundaries on the real embedded cluster (issue 45: Ray Serve's proxy, the router, the
SQLite state store) over real HTTP: a tenant header behind a forged ``X-Forwarded-For`` naming a
trusted proxy unlocks nothing (``trusted_proxies`` set); ``/health`` and ``/ready`` without a key
name no tenant, PID or path (with a key: the details, the caller's own queue only); ``/docs`` and
``/openapi.json`` are off by default; after a start the state file, its WAL files and the key file
are mode 0600 in a 0700 directory."""
from __future__ import annotations

import json
import stat
import subprocess
import sys

import httpx
import pytest

from tests.conftest import api_key, cluster_port

pytestmark = pytest.mark.slow
# one prefill and one decode actor of SmolLM2 with a 128 MiB tier, as in the other modules of this unit
# (tests/conftest.py: their actors are started once and taken over from one module's cluster to the next)
WORKERS_UNIT = "smollm2-tier128"

PROXY = "10.9.8.7"
SECRET = "Victim note: the vault combination is 31-7-22."


@pytest.fixture(scope="module")
def tb(tmp_path_factory, local_ray):
    from tests.conftest import start_cluster as start, stop_cluster as stop
    from kvruntime.config import ClusterConfig

    root = tmp_path_factory.mktemp("tb")
    data = root / "data"
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, data_dir=str(data), trusted_proxies=[PROXY],
                           tenant="victim")
    (root / "c.json").write_text(json.dumps({"data_dir": str(data)}))
    start(cfg, local_cpus=4)
    base = f"http://127.0.0.1:{cfg.server.port}"
    out = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "keys", "create", "--tenant", "attacker", "--config",
                          str(root / "c.json")], capture_output=True, text=True, timeout=120, check=True)
    keys = {"victim": api_key(cfg), "attacker": out.stdout.strip().splitlines()[-1]}
    clients = {t: httpx.Client(base_url=base, timeout=300, headers={"authorization": f"Bearer {k}"})
               for t, k in keys.items()}
    anon = httpx.Client(base_url=base, timeout=60)
    try:
        r = clients["victim"].post("/v1/skills", json={"name": "vault", "text": SECRET})
        assert r.status_code == 201, r.text
        yield cfg, data, clients, anon
    finally:
        for c in (*clients.values(), anon):
            c.close()
        stop(cfg)


def test_a_forged_forwarded_for_unlocks_no_other_tenant(tb):
    cfg, data, clients, anon = tb
    attacker = clients["attacker"]
    for xff in (PROXY, f"{PROXY}, 127.0.0.1", f"203.0.113.9, {PROXY}"):
        headers = {"x-kvnotes-tenant": "victim", "x-forwarded-for": xff}
        r = attacker.get("/v1/skills", headers=headers)
        assert r.status_code in (200, 401, 403), r.text
        assert "vault" not in r.text and "31-7-22" not in r.text, (xff, r.text)
        r = attacker.delete("/v1/skills/vault", headers=headers)
        assert r.status_code in (401, 403, 404), (xff, r.text)
    assert [s["name"] for s in clients["victim"].get("/v1/skills").json()["data"]] == ["vault"]   # untouched


def _names_nothing(text: str, cfg, data) -> None:
    for word in ("victim", "attacker", '"pid"', "workers\": [", str(data), "checkpoint", "profile", "by_tenant"):
        assert word not in text, (word, text)


def test_open_health_and_ready_show_counts_only(tb):
    cfg, data, clients, anon = tb
    h = anon.get("/health")
    assert h.status_code == 200 and h.json()["status"] in ("ok", "degraded")
    _names_nothing(h.text, cfg, data)
    assert all(set(v) == {"live", "total"} for v in h.json()["workers"].values()), h.text
    for headers in ({"authorization": "Bearer kvn-" + "x" * 43}, {"x-kvnotes-tenant": "victim"}):
        _names_nothing(anon.get("/health", headers=headers).text, cfg, data)       # a wrong key: the open view
    _names_nothing(anon.get("/ready").text, cfg, data)
    detailed = clients["attacker"].get("/health").json()
    assert all(w["pid"] for role in detailed["workers"].values() for w in role["workers"])
    assert set(detailed["admission"]["by_tenant"]) <= {"attacker"}                 # its own queue only
    for path in ("/docs", "/openapi.json"):
        r = anon.get(path)
        assert r.status_code == 404 and r.json()["error"]["request_id"], (path, r.text[:200])


def test_state_and_key_files_are_private_after_a_start(tb):
    cfg, data, clients, anon = tb
    db = data / "state.db"
    files = [db, data / "state.db-wal", data / "state.db-shm", cfg.state.api_key_file]
    assert all(f.exists() for f in files), [str(f) for f in files if not f.exists()]
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
    assert modes == {f.name: 0o600 for f in files}, modes
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


def test_unknown_keys_are_rate_limited_per_address_whatever_forwarded_for_says(tb):
    """Random keys from one address, each behind another forged X-Forwarded-For: one bucket (the
    TCP peer's; Serve's proxy rewrites no address), so past the burst they get a 429 with
    Retry-After, and a repeated unknown key is answered from the negative cache. Last in this
    module: the address is out of tokens afterwards."""
    import secrets
    cfg, data, clients, anon = tb
    import time
    codes, t0 = [], time.monotonic()
    for i in range(cfg.server.unknown_key_burst + 10):
        r = anon.get("/v1/skills", headers={"authorization": f"Bearer kvn-{secrets.token_urlsafe(32)}",
                                             "x-forwarded-for": f"198.51.100.{i % 250 + 1}"})
        codes.append(r.status_code)
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
    refilled = (time.monotonic() - t0) * cfg.server.unknown_key_rate_per_s
    assert set(codes) == {401, 429} and codes.count(401) <= cfg.server.unknown_key_burst + refilled + 1, codes
