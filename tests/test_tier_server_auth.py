"""The lm:// tier server as deployed (issue 27): a real server process (kvtransport.tier.server)
and real LMCache stores. Anonymous and wrong-key connections are refused before any command and
counted on the server's own metrics endpoint; the cluster's key works end to end; least recently
used pieces are evicted beyond the capacity, counted; a worker's ``kvnotes_tier_remote_up``
follows a server SIGKILLed by PID and restarted, from the periodic probe alone (no traffic), and
a miss while it is down is counted once, on that worker. Every wait is bounded."""
from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import pytest
import torch
from prometheus_client import generate_latest

from kvruntime.config import TierConfig
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.store import ChunkKey
from kvtransport.tier.auth import MAGIC, NONCE_BYTES, tier_key
from kvtransport.tier.server import start_tier_server, stop_tier_server
from prefill_workers.metrics import worker_registry
from tests.conftest import metric
from tests.tier_chunks import D, H, L, mkkey, mkkv    # a small KV shape: one 256-token fp32 piece is 512 KiB

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

PIECE = L * 2 * H * 256 * D * 4
SECRET = os.urandom(32)                 # this test's cluster secret
KEY = tier_key(SECRET)


def mkstore(url: str, key: bytes = KEY, **cfg) -> LMCacheStore:
    return LMCacheStore("m", "float32", L, H, D, TierConfig(**{"cpu_bytes": 50 << 20, "remote_url": url,
                                                               "remote_timeout_s": 0.5, "remote_probe_s": None, **cfg}),
                        rope="5eed", remote_key=key)


def scrape(srv) -> str:
    return httpx.get(srv.metrics_url, timeout=10).text


def _wait(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.fixture
def server(tmp_path):
    srv = start_tier_server(key=KEY, capacity_bytes=64 << 20, log_path=tmp_path / "tier.log")
    yield srv
    stop_tier_server(srv)


def _lmcache_put_anonymously(srv, key: ChunkKey) -> bytes:
    """What a stock LMCache client does: a PUT header and payload, no handshake. Returns what the
    server sent back before closing."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage

    payload = b"\0" * 4096
    msg = ClientMetaMessage(ClientCommand.PUT, CacheEngineKey("vllm", 1, 0, 0, torch.float32),
                            len(payload), MemoryFormat(1), torch.float32, torch.Size([1, 1, 1, 1024])).serialize()
    got = b""
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.settimeout(10)
        try:
            s.sendall(msg + payload)
            while part := s.recv(4096):
                got += part
        except ConnectionResetError:
            pass
    return got


def test_anonymous_and_wrong_key_clients_are_refused_and_counted(server):
    got = _lmcache_put_anonymously(server, mkkey(256, 0))
    assert got[:len(MAGIC)] == MAGIC and len(got) <= len(MAGIC) + NONCE_BYTES + 1   # a challenge, a NO, closed
    with socket.create_connection((server.host, server.port), timeout=10) as s:        # a partial proof, then gone
        s.recv(len(MAGIC) + NONCE_BYTES)
        s.sendall(b"x" * 10)
    wrong = mkstore(server.url, key=tier_key(os.urandom(32)))
    try:
        k = mkkey(256, 100)
        s = wrong.stats
        assert not s.remote_up and s.remote_auth_refusals == 1
        assert s.remote_last_error.startswith("refused") and "tier key" in s.remote_last_error
        wrong.put(k, mkkv(k))                          # served by its local tier; the remote refused it
        assert wrong.stats.put_tier_failures == {"remote": 1}
    finally:
        wrong.close()
    _wait(lambda: metric(scrape(server), "kvnotes_tier_server_refused_connections_total", reason="no_proof") == 1,
          10, "the partial proof to be counted")
    text = scrape(server)
    # the anonymous PUT, and the wrong-key store's attach probe (its first probe is refused: no attach follows)
    assert metric(text, "kvnotes_tier_server_refused_connections_total", reason="bad_proof") == 2
    assert metric(text, "kvnotes_tier_server_connections_total") >= 1    # start_tier_server's own ready probe
    assert metric(text, "kvnotes_tier_server_entries") == 0 and metric(text, "kvnotes_tier_server_bytes") == 0


def test_with_the_cluster_key_a_chunk_travels_between_stores(server):
    writer, reader = mkstore(server.url), mkstore(server.url)
    try:
        k = mkkey(300, 1000)                            # a full piece and a 44-token tail piece
        kv = mkkv(k, seed=3)
        writer.put(k, kv)
        assert writer.stats.put_tier_failures == {} and reader.stats.remote_up
        got = reader.get(k)                             # the reader's local tier is empty: a remote hit
        assert got is not None and torch.equal(got.data, kv.data)
        assert reader.stats.hits_by_tier == {"remote": 1}
        text = scrape(server)
        assert metric(text, "kvnotes_tier_server_entries") == 2
        assert metric(text, "kvnotes_tier_server_refused_connections_total", reason="bad_proof") == 0
    finally:
        writer.close()
        reader.close()


def test_least_recently_used_pieces_are_evicted_beyond_capacity_and_counted(tmp_path):
    srv = start_tier_server(key=KEY, capacity_bytes=PIECE * 5 // 2, log_path=tmp_path / "tier.log")
    writer = mkstore(srv.url)
    try:
        a, b, c = (mkkey(256, s) for s in (0, 10_000, 20_000))   # one piece each
        writer.put(a, mkkv(a))
        writer.put(b, mkkv(b))
        assert metric(scrape(srv), "kvnotes_tier_server_evictions_total") == 0
        reader = mkstore(srv.url)
        try:
            assert reader.contains(a)                   # a is used again: b is now the least recently used
        finally:
            reader.close()
        writer.put(c, mkkv(c))                          # no room for a third piece: b goes
        text = scrape(srv)
        assert metric(text, "kvnotes_tier_server_evictions_total") == 1
        assert metric(text, "kvnotes_tier_server_evicted_bytes_total") >= PIECE
        assert metric(text, "kvnotes_tier_server_entries") == 2
        assert metric(text, "kvnotes_tier_server_bytes") <= metric(text, "kvnotes_tier_server_capacity_bytes")
        fresh = mkstore(srv.url)                        # an empty local tier: what the server holds
        try:
            assert [fresh.contains(k) for k in (a, b, c)] == [True, False, True]
            got = fresh.get(a)
            assert got is not None and torch.equal(got.data, mkkv(a).data)
        finally:
            fresh.close()
    finally:
        writer.close()
        stop_tier_server(srv)


def _series(store, name: str, **labels) -> float:
    return metric(generate_latest(worker_registry(store, "prefill-0", True)).decode(), name, worker="prefill-0",
                  **labels)


def test_remote_up_follows_a_killed_and_restarted_server_by_probe_alone(server, tmp_path):
    store = mkstore(server.url, remote_probe_s=0.5, remote_retry_s=60)   # operations would not retry for 60 s
    try:
        assert _series(store, "kvnotes_tier_remote_up") == 1
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        _wait(lambda: _series(store, "kvnotes_tier_remote_up") == 0, 10, "the probe to see the server gone")
        assert store.stats.remote_errors == 0 and store.stats.gets == 0   # no operation was involved
        assert _series(store, "kvnotes_fallbacks_total", reason="tier_remote_down") == 0
        k = mkkey(256, 50_000)
        assert store.get(k) is None                     # one miss while down: counted once, here
        assert _series(store, "kvnotes_fallbacks_total", reason="tier_remote_down") == 1
        again = start_tier_server(server.host, server.port, key=KEY, log_path=tmp_path / "again.log")
        try:
            _wait(lambda: _series(store, "kvnotes_tier_remote_up") == 1, 10, "the probe to re-attach")
            assert store.stats.remote_reconnects == 1
            store.put(k, mkkv(k))                       # the restarted (empty) server takes it
            assert "remote" not in store.stats.put_tier_failures
            assert metric(scrape(again), "kvnotes_tier_server_entries") == 1
        finally:
            stop_tier_server(again)
    finally:
        store.close()


def test_kvnotes_tier_server_cli_serves_with_the_cluster_key(tmp_path):
    """`kvnotes tier-server --config F`: the key comes from the cluster secret in F's state store,
    the one every prefill actor derives too; any other key is refused. Stopped by PID."""
    import json
    import subprocess
    import sys

    from cluster.control.ray_backends import tier_key_of
    from kvruntime.config import ClusterConfig
    from kvtransport.tier.lmcache_remote import probe_lm_server
    from tests.conftest import free_port

    port = free_port()
    conf = tmp_path / "kvnotes.json"
    conf.write_text(json.dumps({"data_dir": str(tmp_path / "data"), "tier_remote_url": f"lm://127.0.0.1:{port}",
                                "tier_remote_capacity_bytes": 64 << 20}))
    key = tier_key_of(ClusterConfig.from_file(conf))
    proc = subprocess.Popen([sys.executable, "-m", "cluster.operator.cli", "tier-server", "--config", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cli.log", "wb"),
                            start_new_session=True)
    try:
        _wait(lambda: proc.poll() is not None or probe_lm_server("127.0.0.1", port, 0.5, key), 60,
              "the CLI's tier server to answer")
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()[-2000:]
        assert not probe_lm_server("127.0.0.1", port, 0.5, tier_key(os.urandom(32)))
    finally:
        stop_tier_server(proc.pid)
        proc.wait(timeout=10)
    no_tier = tmp_path / "plain.json"
    no_tier.write_text(json.dumps({"data_dir": str(tmp_path / "data")}))
    r = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "tier-server", "--config", str(no_tier)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "sets no tier_remote_url" in r.stderr, r.stderr
