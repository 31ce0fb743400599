"""Start and stop LMCache's ``lmcache_server`` (the ``lm://`` remote KV tier) by PID.

The server is LMCache's own ``LMCacheServer`` (what the ``lmcache_server`` console script runs),
with one change: its listening socket sets ``SO_REUSEADDR``, so a server restarted after a crash
can bind its port again at once (the stock one fails with EADDRINUSE for ~60 s while the old
connections sit in TIME_WAIT). It keeps every entry in its own memory (no eviction, no delete,
no auth): run it on a trusted network. ``start_tier_server`` returns once the server answers a
health probe (and, by default, makes it exit when the starting process dies: no orphans);
``stop_tier_server`` sends SIGTERM, then SIGKILL after a grace period, to that PID.

Run in the foreground (telemetry off): ``python -m kvtransport.tier_server --port 65432``.
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
from dataclasses import dataclass, field
from pathlib import Path

from kvtransport import lmcache_env
from kvtransport.lmcache_remote import probe_lm_server



@dataclass(frozen=True)
class TierServer:
    host: str
    port: int
    pid: int
    log_path: str | None                                   # server stdout+stderr, if captured
    proc: subprocess.Popen | None = field(default=None, compare=False, repr=False)  # set when we started it

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_tier_server(host: str = "127.0.0.1", port: int = 0, *, log_path: str | Path | None = None,
                      ready_timeout_s: float = 30.0, exit_with_parent: bool = True) -> TierServer:
    """Spawn the server in its own session; wait until it answers. ``port=0`` picks a free
    port. With ``exit_with_parent`` the server also exits (within ~1 s) when this process dies
    without stopping it. Raises ``RuntimeError`` (with the log tail) if it exits or does not
    answer within ``ready_timeout_s``."""
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65536), got {port}")
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "kvtransport.tier_server", "--host", host, "--port", str(port)]
    if exit_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=lmcache_env.child_env(), start_new_session=True)
    finally:
        if log_path:
            out.close()
    server = TierServer(host, port, proc.pid, str(log_path) if log_path else None, proc)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache_server exited with {proc.returncode} on {host}:{port}"
                               f"{_tail(log_path)}")
        if probe_lm_server(host, port, 0.5):
            return server
        time.sleep(0.1)
    stop_tier_server(server)
    raise RuntimeError(f"lmcache_server did not answer on {host}:{port} within {ready_timeout_s}s{_tail(log_path)}")


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


def serve(host: str, port: int, parent_pid: int | None = None) -> None:
    """Run LMCache's server in this process until killed (blocks); with ``parent_pid``, also
    until that process is gone (checked every second)."""
    lmcache_env.prepare()
    if parent_pid is not None:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(0)
        threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    from lmcache.v1.server.__main__ import LMCacheServer
    from lmcache.v1.server.storage_backend import CreateStorageBackend

    class _ReusableServer(LMCacheServer):
        def __init__(self, host: str, port: int, device: str):  # LMCacheServer.__init__ + SO_REUSEADDR
            self.host, self.port = host, port
            self.data_store = CreateStorageBackend(device)
            self.server_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.server_socket.bind((host, port))
            self.server_socket.listen()

    _ReusableServer(host, port, "cpu").run()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run lmcache_server (the lm:// KV tier) in the foreground.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=65432)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    args = ap.parse_args(argv)
    serve(args.host, args.port, args.parent_pid)


if __name__ == "__main__":
    main()
