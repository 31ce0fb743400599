"""TLS for the lm:// tier (issue 45, item 4), stunnel style (kvtransport.tier.tls): a real tier
server process with a TLS terminator (started and stopped by PID) and real LMCache stores whose
client dials a loopback tunnel. A chunk travels between two stores over TLS and a recording relay
on the wire sees neither the KV bytes nor the tier handshake in clear; a client with another CA
refuses the server, a client certificate of another CA is refused by the server, plaintext to the
TLS port gets no challenge; each is counted. Certificates are made here with ``cryptography``
(throwaway CAs). Every wait is bounded."""
from __future__ import annotations

import os
import socket
import threading

import httpx
import pytest
import torch

from kvruntime.config import TierConfig
from kvruntime.config.tier import TierTLS
from kvtransport.tier.auth import MAGIC, tier_key
from kvtransport.tier.lmcache_remote import lm_server_status
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.server import start_tier_server, stop_tier_server
from kvtransport.tier.tls import client_context
from tests.certs import make_pki as _pki
from tests.conftest import metric
from tests.tier_chunks import D, H, L, mkkey, mkkv

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

KEY = tier_key(os.urandom(32))


def _tls_cfg(p: dict, **over) -> dict:
    return {"remote_tls_ca_file": p["ca"], "remote_tls_cert_file": p["cert"], "remote_tls_key_file": p["key"], **over}


def mkstore(url: str, tls: dict, **cfg) -> LMCacheStore:
    return LMCacheStore("m", "float32", L, H, D, TierConfig(**{"cpu_bytes": 50 << 20, "remote_url": url,
                                                               "remote_timeout_s": 3.0, "remote_probe_s": None,
                                                               **tls, **cfg}), rope="5eed", remote_key=KEY)


class _Relay:
    """A TCP relay on the wire between a store and the tier's TLS port: forwards both ways and
    keeps every byte it saw."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.seen, self.lock = target, bytearray(), threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.target, timeout=10)
            self.conns += [c, up]
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._copy, args=(a, b), daemon=True).start()

    def _copy(self, a: socket.socket, b: socket.socket):
        try:
            while data := a.recv(1 << 16):
                with self.lock:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def pki(tmp_path):
    return _pki(tmp_path, "cluster"), _pki(tmp_path, "other")


@pytest.fixture
def server(tmp_path, pki):
    ours, _ = pki
    srv = start_tier_server(key=KEY, capacity_bytes=64 << 20, log_path=tmp_path / "tier.log", ready_timeout_s=120,
                            tls=TierTLS(ours["ca"], ours["cert"], ours["key"]))
    yield srv
    stop_tier_server(srv)


def scrape(srv) -> str:
    return httpx.get(srv.metrics_url, timeout=10).text


def test_a_chunk_travels_over_tls_and_the_wire_shows_no_kv(server, pki):
    ours, _ = pki
    relay = _Relay((server.host, server.port))
    writer = mkstore(f"lm://127.0.0.1:{relay.port}", _tls_cfg(ours))     # through the recording relay
    reader = mkstore(server.url, _tls_cfg(ours))
    try:
        assert writer.stats.remote_up and reader.stats.remote_up
        assert writer._remote.tls_target.startswith("lm://127.0.0.1:")     # LMCache dials the loopback tunnel
        k = mkkey(300, 1000)                                               # a full piece and a 44-token tail
        kv = mkkv(k, seed=3)
        writer.put(k, kv)
        assert writer.stats.put_tier_failures == {}
        got = reader.get(k)                                                # the reader's local tier is empty
        assert got is not None and torch.equal(got.data, kv.data)
        assert reader.stats.hits_by_tier == {"remote": 1}
        with relay.lock:
            wire = bytes(relay.seen)
        raw = kv.data.numpy().tobytes()
        assert len(wire) > len(raw)                                        # the KV went through the relay ...
        assert MAGIC not in wire                                           # ... the handshake not in clear
        assert not any(raw[i:i + 64] in wire for i in range(0, len(raw) - 64, len(raw) // 16))   # nor the KV
        assert writer.stats.remote_tls_connections >= 2 and writer.stats.remote_tls_handshake_failures == 0
        text = scrape(server)
        assert metric(text, "kvnotes_tier_server_entries") == 2
        assert metric(text, "kvnotes_tier_server_tls_connections_total") >= 4   # ready probe, 2 probes, 2 tunnels
        assert metric(text, "kvnotes_tier_server_tls_handshake_failures_total") == 0
    finally:
        writer.close()
        reader.close()
        relay.close()


def test_another_ca_plaintext_and_a_foreign_client_certificate_are_refused_and_counted(server, pki):
    ours, theirs = pki
    wrong_ca = mkstore(server.url, _tls_cfg(ours, remote_tls_ca_file=theirs["ca"]))   # cannot verify the server
    try:
        st = wrong_ca.stats
        assert not st.remote_up and st.remote_auth_refusals == 1 and st.remote_tls_handshake_failures >= 1
        assert st.remote_last_error.startswith("refused") and "certificate" in st.remote_last_error
        k = mkkey(256, 5000)
        wrong_ca.put(k, mkkv(k))                                           # its local tier only
        assert wrong_ca.stats.put_tier_failures == {"remote": 1}
    finally:
        wrong_ca.close()
    foreign = mkstore(server.url, _tls_cfg(theirs, remote_tls_ca_file=ours["ca"]))  # trusts ours, presents theirs
    try:
        st = foreign.stats
        assert not st.remote_up and st.remote_last_error.startswith("refused"), st.remote_last_error
        assert "certificate" in st.remote_last_error and st.remote_tls_handshake_failures >= 1
    finally:
        foreign.close()
    plain = mkstore(server.url, {})                                        # a client without TLS
    try:
        assert not plain.stats.remote_up
    finally:
        plain.close()
    with socket.create_connection((server.host, server.port), timeout=10) as s:   # plaintext bytes to the TLS port
        s.settimeout(10)
        s.sendall(b"\x00" * 64)
        got = b""
        try:
            while part := s.recv(4096):
                got += part
        except OSError:
            pass
        assert MAGIC not in got                                            # no challenge: closed after a TLS alert
    text = scrape(server)
    assert metric(text, "kvnotes_tier_server_tls_handshake_failures_total", reason="certificate") >= 1
    assert metric(text, "kvnotes_tier_server_tls_handshake_failures_total", reason="protocol") >= 1
    assert metric(text, "kvnotes_tier_server_tls_handshake_failures_total") >= 4   # + the other CA's, the plain store's
    assert metric(text, "kvnotes_tier_server_entries") == 0
    ctx = client_context(TierTLS(ours["ca"], ours["cert"], ours["key"]))
    assert lm_server_status(server.host, server.port, 5.0, KEY, ctx) is None   # the cluster's own files get in
    other_name = lm_server_status(server.host, server.port, 5.0, KEY, ctx, server_name="tier.example")
    assert other_name.startswith("refused") and "certificate" in other_name   # a name the certificate lacks


def test_tls_files_are_checked_before_anything_listens(tmp_path, pki):
    ours, _ = pki
    os.chmod(ours["key"], 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        mkstore("lm://127.0.0.1:9", _tls_cfg(ours))
    with pytest.raises(ValueError, match="chmod 600"):
        start_tier_server(key=KEY, tls=TierTLS(ours["ca"], ours["cert"], ours["key"]))
    os.chmod(ours["key"], 0o600)
    with pytest.raises(ValueError, match="cannot read"):
        mkstore("lm://127.0.0.1:9", _tls_cfg(ours, remote_tls_ca_file=str(tmp_path / "missing.pem")))
    for bad, why in (({"remote_tls_cert_file": ours["cert"]}, "need tier_remote_url and tier_remote_tls_ca_file"),
                     ({"remote_tls_ca_file": ours["ca"], "remote_tls_cert_file": ours["cert"]}, "go together"),
                     ({"remote_tls_ca_file": ours["ca"]}, "client_auth needs"),
                     ({"remote_tls_ca_file": ours["ca"], "remote_tls_client_auth": False,
                       "remote_tls_server_name": "a b"}, "non-empty string")):
        with pytest.raises(ValueError, match=why):
            TierConfig(remote_url="lm://127.0.0.1:9", **bad)
    from kvruntime.config import ClusterConfig
    cfg = ClusterConfig.of(tier_remote_url="lm://127.0.0.1:9", tier_remote_tls_ca_file=ours["ca"],
                           tier_remote_tls_client_auth=False)
    assert cfg.tier.remote_tls == TierTLS(ours["ca"], client_auth=False)


def test_kvnotes_tier_server_reads_the_tls_settings_from_the_config(tmp_path, pki):
    """`kvnotes tier-server --config F` with `tier_remote_tls_*` in F serves TLS only: a probe with
    the cluster's files gets in, a plain one does not. Stopped by PID."""
    import json
    import subprocess
    import sys

    from cluster.control.ray_backends import tier_key_of
    from kvruntime.config import ClusterConfig
    from tests.conftest import free_port, wait_for

    ours, _ = pki
    port = free_port()
    conf = tmp_path / "kvnotes.json"
    conf.write_text(json.dumps({"data_dir": str(tmp_path / "data"), "tier_remote_url": f"lm://127.0.0.1:{port}",
                                "tier_remote_capacity_bytes": 64 << 20,
                                **{f"tier_{k}": v for k, v in _tls_cfg(ours).items()}}))
    cfg = ClusterConfig.from_file(conf)
    key, ctx = tier_key_of(cfg), client_context(cfg.tier.remote_tls)
    proc = subprocess.Popen([sys.executable, "-m", "cluster.operator.cli", "tier-server", "--config", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cli.log", "wb"), start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or lm_server_status("127.0.0.1", port, 2.0, key, ctx) is None, 120,
                 "the CLI's TLS tier server to answer", every=0.2)
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()[-2000:]
        assert lm_server_status("127.0.0.1", port, 1.0, key) is not None          # plain TCP gets no challenge
    finally:
        stop_tier_server(proc.pid)
        proc.wait(timeout=10)


def test_the_tunnel_follows_a_tls_server_killed_and_restarted(tmp_path, pki):
    """The tunnel's connection ends with the server's (SIGKILL by PID): the probe marks the tier
    down, re-attaches through the tunnel to the restarted server, and a put reaches it."""
    import signal

    from tests.conftest import wait_for
    ours, _ = pki
    tls = TierTLS(ours["ca"], ours["cert"], ours["key"])
    srv = start_tier_server(key=KEY, capacity_bytes=64 << 20, log_path=tmp_path / "tier.log", tls=tls,
                            ready_timeout_s=120)
    store = mkstore(srv.url, _tls_cfg(ours), remote_probe_s=0.5, remote_retry_s=60)
    again = None
    try:
        assert store.stats.remote_up
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(timeout=10)
        wait_for(lambda: not store.stats.remote_up, 10, "the probe to see the server gone", every=0.1)
        again = start_tier_server(srv.host, srv.port, key=KEY, capacity_bytes=64 << 20,
                                  log_path=tmp_path / "again.log", tls=tls, ready_timeout_s=120)
        wait_for(lambda: store.stats.remote_up, 15, "the probe to re-attach through the tunnel", every=0.1)
        assert store.stats.remote_reconnects == 1
        k = mkkey(256, 70_000)
        store.put(k, mkkv(k))
        assert "remote" not in store.stats.put_tier_failures
        assert metric(scrape(again), "kvnotes_tier_server_entries") == 1
    finally:
        store.close()
        stop_tier_server(srv)
        if again is not None:
            stop_tier_server(again)
