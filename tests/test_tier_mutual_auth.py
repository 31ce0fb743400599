"""The lm:// handshake proves both ends (issue 45, item 4): against a real tier server process
(started and stopped by PID) a recorded proof replayed on a new connection is refused and
counted; an impostor that answers at the tier's address without the key (a real listening socket
here) is refused by the client, and an LMCache store never attaches to it. Every wait is bounded."""
from __future__ import annotations

import os
import socket
import threading

import httpx
import pytest

from kvtransport.tier.auth import MAGIC, NO, NONCE_BYTES, OK, PROOF_BYTES, TierAuthError, client_handshake, proof, tier_key
from kvtransport.tier.lmcache_remote import lm_server_status
from kvtransport.tier.server import start_tier_server, stop_tier_server
from tests.conftest import metric

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

KEY = tier_key(os.urandom(32))


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            break
        buf += part
    return buf


def test_a_replayed_client_proof_is_refused_and_counted(tmp_path):
    srv = start_tier_server(key=KEY, capacity_bytes=16 << 20, log_path=tmp_path / "tier.log")
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:     # a legitimate handshake, recorded
            s.settimeout(10)
            hello = _recv(s, len(MAGIC) + NONCE_BYTES)
            assert hello[:len(MAGIC)] == MAGIC
            ns, nc = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
            recorded = nc + proof(KEY, b"client", ns, nc)
            s.sendall(recorded)
            answer = _recv(s, 1 + PROOF_BYTES)
            assert answer[:1] == OK and answer[1:] == proof(KEY, b"server", ns, nc)     # the server proved the key
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:     # the same bytes, replayed
            s.settimeout(10)
            _recv(s, len(MAGIC) + NONCE_BYTES)
            s.sendall(recorded)
            assert _recv(s, 1 + PROOF_BYTES) == NO                               # refused, then closed
        text = httpx.get(srv.metrics_url, timeout=10).text
        assert metric(text, "kvnotes_tier_server_refused_connections_total", reason="bad_proof") == 1
        assert lm_server_status(srv.host, srv.port, 5.0, KEY) is None            # the real client still gets in
    finally:
        stop_tier_server(srv)


class _Impostor:
    """Listens where a tier server would, speaks the handshake's framing, accepts any proof and
    answers with a proof it cannot compute (it has no key)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.commands_seen = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            with c:
                c.settimeout(5)
                try:
                    c.sendall(MAGIC + os.urandom(NONCE_BYTES))
                    _recv(c, NONCE_BYTES + PROOF_BYTES)
                    c.sendall(OK + os.urandom(PROOF_BYTES))
                    if _recv(c, 1):
                        self.commands_seen += 1          # the client went on to send a command
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def test_a_client_refuses_a_server_that_cannot_prove_the_key():
    imp = _Impostor()
    try:
        with socket.create_connection(("127.0.0.1", imp.port), timeout=5) as s:
            s.settimeout(5)
            with pytest.raises(TierAuthError, match="did not prove the tier key"):
                client_handshake(s, KEY, f"127.0.0.1:{imp.port}")
        why = lm_server_status("127.0.0.1", imp.port, 5.0, KEY)
        assert why is not None and why.startswith("refused") and "did not prove" in why
        from kvruntime.config import TierConfig
        from kvtransport.tier.lmcache_store import LMCacheStore
        store = LMCacheStore("m", "float32", 2, 2, 64, TierConfig(cpu_bytes=8 << 20, remote_url=f"lm://127.0.0.1:{imp.port}",
                                                                  remote_timeout_s=1.0, remote_probe_s=None),
                             rope="5eed", remote_key=KEY)
        try:
            st = store.stats
            assert not st.remote_up and st.remote_auth_refusals == 1 and "did not prove" in st.remote_last_error
        finally:
            store.close()
        assert imp.commands_seen == 0                     # no lookup, no command ever reached the impostor
    finally:
        imp.close()
