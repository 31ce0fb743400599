"""Start and stop the ``lm://`` remote KV tier server by PID: LMCache's ``LMCacheServer`` (what
the ``lmcache_server`` console script runs) with three changes:

- every connection must first prove the cluster's tier key, and the server proves it back
  (``kvtransport.tier.auth``: a mutual challenge-response over both ends' nonces, the key never
  crosses the wire; a client refuses a server that cannot prove it); anonymous, wrong-key or
  replayed proofs are refused before any command and counted
  (``kvnotes_tier_server_refused_connections_total``);
- it holds at most ``capacity_bytes`` and evicts the least recently used pieces beyond it
  (``kvtransport.tier.lru``, counted in ``kvnotes_tier_server_evictions_total``);
- its listening socket sets ``SO_REUSEADDR``, so a server restarted after a crash binds its port
  again at once (the stock one fails with EADDRINUSE for ~60 s while old connections sit in
  TIME_WAIT).
- with TLS (``tls=``, the config's ``tier_remote_tls_*``), the configured address is a TLS
  terminator (``kvtransport.tier.tls``: a client certificate of the CA required unless
  ``client_auth`` is off, handshake failures counted in
  ``kvnotes_tier_server_tls_handshake_failures_total{reason}``) forwarding to LMCache's server on
  a loopback port of its own; the tier key's handshake still runs inside TLS.
Still no delete and no persistence: entries live in the server's memory until evicted or the
server stops. ``start_tier_server`` returns once the server answers an authenticated health
probe (and, by default, makes it exit when the starting process dies: no orphans);
``stop_tier_server`` sends SIGTERM, then SIGKILL after a grace period, to that PID. With a
metrics port the server exports its series on ``http://host:metrics_port/metrics``.

Foreground (telemetry off), the key in a file (32 raw bytes or 64 hex characters):
``python -m kvtransport.tier.server --port 65432 --key-file KEY --capacity-bytes 4294967296``;
``kvnotes tier-server --config FILE`` derives the key from the cluster's state store instead.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvruntime.config.tier import TierTLS
from kvtransport.tier import lmcache_env
from kvtransport.tier.lmcache_remote import probe_lm_server
from kvtransport.tier.auth import KEY_ENV, check_key

DEFAULT_CAPACITY_BYTES = 4 << 30
AUTH_TIMEOUT_S = 5.0             # a connection must prove the key within this, else refused (no_proof)


@dataclass(frozen=True)
class TierServer:
    host: str
    port: int
    pid: int
    log_path: str | None                                   # server stdout+stderr, if captured
    proc: subprocess.Popen | None = field(default=None, compare=False, repr=False)  # set when we started it
    metrics_port: int | None = None                        # its Prometheus endpoint, if exported

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://{self.host}:{self.metrics_port}/metrics"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_tier_server(host: str = "127.0.0.1", port: int = 0, *, key: bytes,
                      capacity_bytes: int = DEFAULT_CAPACITY_BYTES, metrics_port: int | None = 0,
                      log_path: str | Path | None = None, ready_timeout_s: float = 30.0,
                      exit_with_parent: bool = True, tls: TierTLS | None = None) -> TierServer:
    """Spawn the server in its own session; wait until it answers a health probe made with
    ``key`` (the tier key, ``kvtransport.tier.auth.tier_key`` of the cluster secret; handed to the
    child in its environment, never on its command line). ``port=0`` / ``metrics_port=0`` pick
    free ports; ``metrics_port=None`` exports nothing. With ``exit_with_parent`` the server also
    exits (within ~1 s) when this process dies without stopping it. Raises ``RuntimeError`` (with
    the log tail) if it exits or does not answer within ``ready_timeout_s``. ``tls``: serve TLS
    (``kvtransport.tier.tls``; the readiness probe dials it with the same files)."""
    check_key(key)
    probe_tls = None
    if tls is not None:
        from kvtransport.tier.tls import checked_files, client_context
        checked_files(tls, server=True)
        probe_tls = client_context(tls)
    if not 0 <= port < 65536 or (metrics_port is not None and not 0 <= metrics_port < 65536):
        raise ValueError(f"ports must be in [0, 65536), got {port} and {metrics_port}")
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "kvtransport.tier.server", "--host", host, "--port", str(port),
           "--capacity-bytes", str(capacity_bytes)]
    if metrics_port is not None:
        metrics_port = metrics_port or free_port(host)
        cmd += ["--metrics-port", str(metrics_port)]
    if exit_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    cmd += tls_args(tls)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**lmcache_env.child_env(), KEY_ENV: key.hex()}, start_new_session=True)
    finally:
        if log_path:
            out.close()
    server = TierServer(host, port, proc.pid, str(log_path) if log_path else None, proc, metrics_port)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lm:// tier server exited with {proc.returncode} on {host}:{port}"
                               f"{_tail(log_path)}")
        if probe_lm_server(host, port, 0.5 if tls is None else 2.0, key, probe_tls, tls and tls.server_name):
            return server
        time.sleep(0.1)
    stop_tier_server(server)
    raise RuntimeError(f"lm:// tier server did not answer on {host}:{port} within {ready_timeout_s}s{_tail(log_path)}")


def stop_tier_server(server: TierServer | int, grace_s: float = 5.0) -> None:
    """Stop the server with this PID: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
    pid = server if isinstance(server, int) else server.pid
    proc = None if isinstance(server, int) else server.proc
    for sig in (signal.SIGCONT, signal.SIGTERM):   # SIGCONT: a stopped server cannot handle SIGTERM
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid, proc):
        time.sleep(0.05)
    if _alive(pid, proc):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc is not None:
        proc.wait(timeout=grace_s)


def _alive(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(log_path: str | Path | None, n: int = 2000) -> str:
    if not log_path or not Path(log_path).exists():
        return ""
    return "\n--- server log tail ---\n" + Path(log_path).read_bytes()[-n:].decode(errors="replace")


def tls_args(tls: TierTLS | None) -> list[str]:
    """The ``--tls-*`` arguments of ``python -m kvtransport.tier.server`` for ``tls`` (paths only)."""
    if tls is None:
        return []
    args = ["--tls-ca-file", tls.ca_file, "--tls-cert-file", tls.cert_file or "", "--tls-key-file", tls.key_file or ""]
    return args + ([] if tls.client_auth else ["--no-tls-client-auth"])


def _terminator(host: str, port: int, tls: TierTLS, backend_port: int):
    """The TLS listener on (host, port) that forwards to LMCache's server on 127.0.0.1:backend_port."""
    from kvtransport.tier.tls import Forwarder, server_context
    return Forwarder((host, port), ("127.0.0.1", backend_port), accept_tls=server_context(tls),
                     handshake_timeout_s=AUTH_TIMEOUT_S, name="kvnotes-tier-tls-terminator")


def serve(host: str, port: int, key: bytes, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, *,
          parent_pid: int | None = None, metrics_port: int | None = None, tls: TierTLS | None = None) -> None:
    """Run the server in this process until killed (blocks); with ``parent_pid``, also until that
    process is gone (checked every second). ``metrics_port``: export the server's series there.
    ``tls``: (host, port) is a TLS terminator (``kvtransport.tier.tls``) and LMCache's server
    listens on a loopback port of its own."""
    check_key(key)
    if tls is not None:
        from kvtransport.tier.tls import server_context
        server_context(tls)       # files and key mode checked before anything listens
    lmcache_env.prepare()
    if parent_pid is not None:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(0)
        threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    import logging

    from lmcache.v1.server.__main__ import LMCacheServer

    from kvtransport.tier.auth import server_handshake
    from kvtransport.tier.lru import LRUPieceStore, TierServerCollector

    log = logging.getLogger("kvtransport.tier.server")
    store = LRUPieceStore(capacity_bytes)
    connections: Counter[str] = Counter()   # accepted | bad_proof | no_proof (under count_lock)
    count_lock = threading.Lock()

    class _Server(LMCacheServer):
        def __init__(self):  # LMCacheServer.__init__ with our store and SO_REUSEADDR (behind TLS: on loopback)
            self.host, self.port = (host, port) if tls is None else ("127.0.0.1", 0)
            self.data_store = store
            self.server_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.server_socket.bind((self.host, self.port))
            self.server_socket.listen()
            self.port = self.server_socket.getsockname()[1]

        def _serve_one(self, sock: socket.socket, addr) -> None:
            refused = server_handshake(sock, key, AUTH_TIMEOUT_S)
            with count_lock:
                connections[refused or "accepted"] += 1
                n = connections[refused or "accepted"]
            if refused is not None:
                if n in (1, 10, 100) or n % 1000 == 0:     # logged, not flooded: the counter has them all
                    log.warning("refused a connection from %s: %s (%d so far)", addr[0], refused, n)
                sock.close()
                return
            self.handle_client(sock)

        def run(self) -> None:
            log.warning("lm:// tier server on %s:%s%s, capacity %d bytes, tier key required", host, port,
                        "" if tls is None else f" (TLS, to LMCache on 127.0.0.1:{self.port})", capacity_bytes)
            try:
                while True:
                    sock, addr = self.server_socket.accept()
                    threading.Thread(target=self._serve_one, args=(sock, addr), daemon=True).start()
            finally:
                self.server_socket.close()

    server = _Server()
    terminator = None if tls is None else _terminator(host, port, tls, server.port)
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from kvruntime.telemetry import start_exporter
        reg = CollectorRegistry()
        reg.register(TierServerCollector(store, connections, terminator and terminator.counts))
        start_exporter(reg, host=host, port=metrics_port)
    server.run()


def _read_key(path: str | None) -> bytes:
    """The tier key from ``--key-file`` (32 raw bytes or 64 hex characters) or ``$KVNOTES_TIER_KEY``."""
    raw = Path(path).read_bytes().strip() if path else os.environ.pop(KEY_ENV, "").encode()
    if len(raw) == 64:
        try:
            raw = bytes.fromhex(raw.decode())
        except ValueError:
            pass
    return check_key(raw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the lm:// KV tier server (LMCache's, authenticated, LRU) "
                                             "in the foreground.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=65432)
    ap.add_argument("--key-file", default=None, help=f"the tier key (32 bytes or 64 hex); default ${KEY_ENV}")
    ap.add_argument("--capacity-bytes", type=int, default=DEFAULT_CAPACITY_BYTES,
                    help="least recently used pieces are evicted beyond this")
    ap.add_argument("--metrics-port", type=int, default=None, help="export Prometheus series on this port")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    ap.add_argument("--tls-ca-file", default=None, help="serve TLS: the CA client certificates are checked against")
    ap.add_argument("--tls-cert-file", default=None, help="with --tls-ca-file: this server's certificate")
    ap.add_argument("--tls-key-file", default=None, help="with --tls-ca-file: its key (mode 0600)")
    ap.add_argument("--no-tls-client-auth", action="store_true", help="TLS without client certificates")
    args = ap.parse_args(argv)
    try:
        key = _read_key(args.key_file)
        if args.capacity_bytes <= 0:
            raise ValueError(f"--capacity-bytes must be > 0, got {args.capacity_bytes}")
        tls = None
        if args.tls_ca_file or args.tls_cert_file or args.tls_key_file:
            if not args.tls_ca_file:
                raise ValueError("--tls-cert-file / --tls-key-file need --tls-ca-file (TLS is on with the CA)")
            tls = TierTLS(args.tls_ca_file or "", args.tls_cert_file or None, args.tls_key_file or None,
                          client_auth=not args.no_tls_client_auth)
            from kvtransport.tier.tls import checked_files
            checked_files(tls, server=True)
    except (OSError, ValueError) as exc:
        sys.exit(f"tier_server: {exc}")
    serve(args.host, args.port, key, args.capacity_bytes, parent_pid=args.parent_pid,
          metrics_port=args.metrics_port, tls=tls)


if __name__ == "__main__":
    main()
