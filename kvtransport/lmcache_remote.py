"""The ``lm://`` remote tier inside an LMCache engine: bounded, observed, reconnecting.

LMCache 0.5.6's ``lm://`` client (``LMCServerConnector``) uses a blocking socket with no timeout
(a hung server blocks ``contains`` forever), swallows errors into misses, and never replaces a
broken socket by itself (only after its connection was never made). :class:`RemoteTier` owns that backend for an :class:`LMCacheStore`:

1. attach: probe the server (connect + HEALTH, bounded), then build LMCache's own
   ``RemoteBackend`` for the URL, bound its socket with ``timeout_s`` and wrap its connector in
   a tap that records every failure (exceptions, timeouts, cancellations);
2. after each store operation, :meth:`after_op` reports whether the remote failed; a failure
   marks the tier *down*: LMCache bypasses it (requests use the local tiers and miss otherwise);
3. while down, :meth:`before_op` retries the attach at most every ``retry_s`` seconds.
States: up (attached, in use) -> down (bypassed) -> up (re-attached). Each transition is logged
once; counters are read by the store's stats. Not thread-safe: the store's lock serialises use.
"""
from __future__ import annotations

import inspect
import logging
import socket
import threading
import time
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

BACKEND = "RemoteBackend"   # LMCache's name for the backend built from ``remote_url``


def parse_lm_url(url: str) -> tuple[str, int]:
    """``"lm://host:port"`` -> (host, port); ``ValueError`` otherwise."""
    if not isinstance(url, str) or not url.startswith("lm://"):
        raise ValueError(f"remote_url must look like 'lm://host:port', got {url!r}")
    host, sep, port = url[len("lm://"):].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote_url must look like 'lm://host:port', got {url!r}")
    return host, int(port)


def probe_lm_server(host: str, port: int, timeout_s: float) -> bool:
    """True if an ``lmcache_server`` answers HEALTH within ``timeout_s`` (connect + one round
    trip on a fresh socket). Never raises for network errors."""
    from kvtransport import lmcache_env
    lmcache_env.prepare()
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

    msg = ClientMetaMessage(ClientCommand.HEALTH, CacheEngineKey("kvnotes-probe", 1, 0, 0, torch.float16),
                            0, MemoryFormat(1), torch.float16, torch.Size([0, 0, 0, 0])).serialize()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(msg)
            want, buf = ServerMetaMessage.packlength(), b""
            while len(buf) < want:
                part = s.recv(want - len(buf))
                if not part:
                    return False
                buf += part
        return ServerMetaMessage.deserialize(buf).code == ServerReturnCode.SUCCESS
    except (OSError, ValueError):
        return False


class _FailureTap:
    """Delegates to LMCache's remote connector and reports every exception it raises."""

    def __init__(self, inner: Any, on_error: Callable[[str, BaseException], None]):
        self._inner = inner
        self._on_error = on_error

    @property
    def inner(self) -> Any:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if inspect.iscoroutinefunction(attr):
            async def tapped(*a, **kw):
                try:
                    return await attr(*a, **kw)
                except BaseException as e:  # incl. CancelledError from LMCache's own timeouts
                    self._on_error(name, e)
                    raise
            return tapped
        if callable(attr):
            def tapped_sync(*a, **kw):
                try:
                    return attr(*a, **kw)
                except Exception as e:
                    self._on_error(name, e)
                    raise
            return tapped_sync
        return attr


def _client_socket(connection: Any) -> socket.socket:
    """The blocking socket inside LMCache 0.5.6's lm:// connector (Instrumented -> LMCServer)."""
    inner = getattr(connection, "_connector", None)
    sock = getattr(inner, "client_socket", None)
    if not isinstance(sock, socket.socket):
        raise RuntimeError("LMCache's lm:// connector changed shape (expected "
                           "InstrumentedRemoteConnector._connector.client_socket); remote timeouts "
                           "cannot be bounded. kvnotes is pinned to lmcache==0.5.6.")
    return sock


class RemoteTier:
    """Owns the ``lm://`` backend of one LMCache engine (see the module doc for the states)."""

    def __init__(self, url: str, engine: Any, timeout_s: float, retry_s: float):
        self.url = url
        self.host, self.port = parse_lm_url(url)
        self._engine = engine          # lmcache LMCacheEngine (post-initialised)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.up = False
        self.errors = 0                # failed remote operations (exceptions, timeouts)
        self.reconnects = 0            # successful attaches after the first
        self._attached_once = False
        self._next_try = 0.0           # monotonic time of the next attach attempt while down
        self._failed = threading.Event()   # set by the tap (LMCache's event-loop thread)
        self._last_error = ""
        self._down_logged = False      # one warning per outage
        self._backend: Any = None
        self._try_attach()

    # ---- per-operation hooks ---------------------------------------------------------------
    def before_op(self) -> bool:
        """Retry the attach if down and due. Returns whether the remote is up for this op."""
        if not self.up and time.monotonic() >= self._next_try:
            self._try_attach()
        return self.up

    def after_op(self) -> bool:
        """Mark the tier down if it failed during the op. Returns True if the remote was not
        usable for (some of) the op: down before it, or failed during it."""
        failed = self._failed.is_set()
        self._failed.clear()
        be = self._backend
        if self.up and (failed or be is None or be.connection is None):
            self._mark_down(self._last_error or "connection lost")
        return not self.up or failed

    def close(self) -> None:
        self._close_socket(self._backend)
        self._backend = None
        self.up = False

    # ---- internals ---------------------------------------------------------------------------
    def _record(self, op: str, exc: BaseException) -> None:
        self.errors += 1
        self._last_error = f"{op}: {type(exc).__name__}: {exc}"
        self._failed.set()

    def _try_attach(self) -> None:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self._next_try = time.monotonic() + self.retry_s
        if not probe_lm_server(self.host, self.port, self.timeout_s):
            self._mark_down(f"no answer from {self.host}:{self.port} within {self.timeout_s}s")
            return
        sm = self._engine.storage_manager
        be = RemoteBackend(self._engine.config, self._engine.metadata, sm.loop, sm.local_cpu_backend,
                           dst_device="cpu")
        if be.connection is None:
            self._mark_down("LMCache could not connect")
            return
        _client_socket(be.connection).settimeout(self.timeout_s)
        be.connection = _FailureTap(be.connection, self._record)
        with sm.manager_lock:
            old = sm.storage_backends.pop(BACKEND, None)
            sm.storage_backends[BACKEND] = be          # last in lookup order: after local + fs
            sm.non_allocator_backends = sm.get_non_allocator_backends()
        sm.set_backend_bypass(BACKEND, False)
        self._close_socket(old)
        self._backend = be
        self._failed.clear()
        self._down_logged = False
        if self._attached_once:
            self.reconnects += 1
            log.warning("remote KV tier %s is back: reconnected", self.url)
        self._attached_once = True
        self.up = True

    def _mark_down(self, reason: str) -> None:
        sm = self._engine.storage_manager
        if BACKEND in sm.storage_backends:
            sm.set_backend_bypass(BACKEND, True)
        if not self._down_logged:
            log.warning("remote KV tier %s is down (%s): lookups miss and callers recompute; "
                        "retrying every %.1fs", self.url, reason, self.retry_s)
            self._down_logged = True
        self.up = False
        self._next_try = time.monotonic() + self.retry_s

    @staticmethod
    def _close_socket(be: Any) -> None:
        """Close a backend's socket directly (bounded: never waits on LMCache's event loop)."""
        conn = getattr(be, "connection", None)
        if conn is None:
            return
        try:
            _client_socket(conn.inner if isinstance(conn, _FailureTap) else conn).close()
        except (OSError, RuntimeError):
            pass
