"""The ``lm://`` remote tier inside an LMCache engine: authenticated, bounded, observed,
reconnecting, probed.

LMCache 0.5.6's ``lm://`` client (``LMCServerConnector``) uses a blocking socket with no timeout
(a hung server blocks ``contains`` forever), swallows errors into misses, and never replaces a
broken socket by itself (only after its connection was never made). :class:`RemoteTier` owns that
backend for an :class:`LMCacheStore`:

1. attach: probe the server (connect, answer its tier-key challenge, HEALTH; bounded), then build
   LMCache's own ``RemoteBackend`` for the URL, answer the challenge on its fresh socket
   (``kvtransport.tier.auth``), bound the socket with ``timeout_s`` and wrap its connector in a
   tap that records every failure (exceptions, timeouts, cancellations);
2. after each store operation, :meth:`after_op` reports whether the remote failed; a failure
   marks the tier *down*: LMCache bypasses it (requests use the local tiers and miss otherwise);
3. while down, :meth:`before_op` retries the attach at most every ``retry_s`` seconds;
4. with ``probe_s``, a thread probes the server every ``probe_s`` seconds, traffic or not: a
   failed probe (or the server closing our connection: it restarted) marks the tier down, a
   good one while down re-attaches. So :attr:`up` (``kvnotes_tier_remote_up``) follows the
   server within ``probe_s + timeout_s``.
States: up (attached, in use) -> down (bypassed) -> up (re-attached). Each transition is logged
once; a refused tier key is logged as an error naming the cause and counted (``auth_refusals``).
Not thread-safe by itself: every method runs under the store's lock (the probe thread takes it
only to apply a result, never across a network round trip of its own).
"""
from __future__ import annotations

import inspect
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

import torch

from kvruntime.config.tier import TierTLS, parse_lm_url   # the one lm:// URL check (the config validates with it)
from kvtransport.tier.tls import TlsCounts

log = logging.getLogger(__name__)

BACKEND = "RemoteBackend"   # LMCache's name for the backend built from ``remote_url``


def lm_server_status(host: str, port: int, timeout_s: float, key: bytes, tls: ssl.SSLContext | None = None,
                     server_name: str | None = None, counts: TlsCounts | None = None) -> str | None:
    """None if the tier server proves reachable: connect (over TLS with ``tls``, the server's
    certificate checked for ``server_name`` or ``host``; ``counts`` counts the handshake), answer
    its challenge with ``key`` (``kvtransport.tier.auth``), one HEALTH round trip, each bounded by
    ``timeout_s`` on a fresh socket. Else why not, in one line (``"refused: ..."`` when the server
    refused the key, or a TLS handshake failed). Never raises for network errors."""
    from kvtransport.tier import lmcache_env
    from kvtransport.tier.auth import TierAuthError
    lmcache_env.prepare()
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

    msg = ClientMetaMessage(ClientCommand.HEALTH, CacheEngineKey("kvnotes-probe", 1, 0, 0, torch.float16),
                            0, MemoryFormat(1), torch.float16, torch.Size([0, 0, 0, 0])).serialize()
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            raw.settimeout(timeout_s)
            with (raw if tls is None else _tls_wrap(raw, tls, server_name or host, where, counts)) as s:
                _answer_challenge(s, key, where, tls is not None, counts)
                s.sendall(msg)
                want, buf = ServerMetaMessage.packlength(), b""
                while len(buf) < want:
                    part = s.recv(want - len(buf))
                    if not part:
                        return f"{where} closed the connection during HEALTH"
                    buf += part
        if ServerMetaMessage.deserialize(buf).code != ServerReturnCode.SUCCESS:
            return f"{where} answered HEALTH with a failure"
        return None
    except (TierAuthError, TierTLSError) as exc:
        return f"refused: {exc}"
    except ssl.SSLError as exc:     # TLS 1.3: the server's refusal of our certificate arrives on the first read
        line = counts.handshake_failed(exc, where) if counts is not None else f"TLS with {where} failed: {exc}"
        return f"refused: {line}"
    except (OSError, ValueError) as exc:
        return f"no answer from {where} within {timeout_s}s ({type(exc).__name__}: {exc})"


def _answer_challenge(sock: socket.socket, key: bytes, where: str, over_tls: bool, counts: TlsCounts | None) -> None:
    """``client_handshake``; over TLS a close before the challenge is the terminator's refusal of
    this end's certificate (TLS 1.3 sends it after the client's side of the handshake is done),
    raised as :class:`TierTLSError` and counted (reason ``closed``)."""
    from kvtransport.tier.auth import TierAuthError, client_handshake
    try:
        client_handshake(sock, key, where)
    except ConnectionError as exc:
        if not over_tls or isinstance(exc, TierAuthError):
            raise
        why = ConnectionError(f"{where} closed the TLS connection before its challenge: it refused this end's "
                              "certificate (tier_remote_tls_cert_file not of its CA?) or cannot reach its LMCache server")
        raise TierTLSError(counts.handshake_failed(why, where) if counts is not None else str(why)) from exc


class TierTLSError(ConnectionError):
    """A TLS handshake with the tier server failed (its certificate is not of the configured CA or
    does not name it, or it does not speak TLS)."""


def _tls_wrap(sock: socket.socket, ctx: ssl.SSLContext, server_name: str, where: str,
              counts: TlsCounts | None) -> ssl.SSLSocket:
    """``sock`` after a TLS handshake (bounded by its timeout). A failed one is counted and raised
    as :class:`TierTLSError` naming what failed; a timeout or reset stays itself (counted too)."""
    try:
        tls_sock = ctx.wrap_socket(sock, server_hostname=server_name)
    except (OSError, EOFError) as exc:
        line = counts.handshake_failed(exc, where) if counts is not None else f"TLS handshake with {where} failed: {exc}"
        if isinstance(exc, ssl.SSLError):
            raise TierTLSError(line) from exc
        raise
    if counts is not None:
        counts.bump("connections")
    return tls_sock


def probe_lm_server(host: str, port: int, timeout_s: float, key: bytes, tls: ssl.SSLContext | None = None,
                    server_name: str | None = None) -> bool:
    """True if the tier server answers an authenticated HEALTH within ``timeout_s``."""
    return lm_server_status(host, port, timeout_s, key, tls, server_name) is None


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

    def __init__(self, url: str, engine: Any, timeout_s: float, retry_s: float, key: bytes,
                 lock: threading.RLock, probe_s: float | None = None, tls: TierTLS | None = None):
        from kvtransport.tier.auth import check_key
        self.url = url
        self.host, self.port = parse_lm_url(url)
        self._engine = engine          # lmcache LMCacheEngine (post-initialised)
        self.tls_counts = TlsCounts()  # TLS handshakes of the tunnel and the probes (with tls)
        self._tls_ctx, self._tunnel, self._server_name = None, None, None
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._key = check_key(key)
        self._lock = lock              # the store's: serialises ops, attaches and probe results
        self.up = False
        self.errors = 0                # failed remote operations (exceptions, timeouts)
        self.reconnects = 0            # successful attaches after the first
        self.auth_refusals = 0         # attaches or probes the server refused (wrong tier key)
        self.probes = 0                # periodic probes made
        self.last_error = ""           # why the tier went down last (one line)
        self._attached_once = False
        self._next_try = 0.0           # monotonic time of the next attach attempt while down
        self._failed = threading.Event()   # set by the tap (LMCache's event-loop thread)
        self._last_op_error = ""
        self._down_logged = False      # one warning per outage
        self._backend: Any = None
        self._stop = threading.Event()
        if tls is not None:
            self._start_tunnel(tls)
        try:
            with lock:
                self._try_attach()
        except BaseException:
            self.close()
            raise
        self._prober = None
        if probe_s is not None:
            self._prober = threading.Thread(target=self._probe_loop, args=(probe_s,), daemon=True,
                                            name=f"kvnotes-tier-probe-{self.port}")
            self._prober.start()

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
            self._mark_down(self._last_op_error or "connection lost")
        return not self.up or failed

    def stop_probe(self) -> None:
        """Stop the probe thread (call without holding the store's lock); waits for it, bounded."""
        self._stop.set()
        if self._prober is not None and self._prober is not threading.current_thread():
            self._prober.join(timeout=self.timeout_s + 2.0)

    def close(self) -> None:
        self._stop.set()
        self._close_socket(self._backend)
        self._backend = None
        self.up = False
        if self._tunnel is not None:
            self._tunnel.close()

    @property
    def tls_target(self) -> str | None:
        """Where LMCache's client connects when TLS is on: the tunnel's loopback ``lm://`` URL."""
        return None if self._tunnel is None else self._tunnel.url

    # ---- internals ---------------------------------------------------------------------------
    def _start_tunnel(self, tls: TierTLS) -> None:
        """TLS on: LMCache's client dials a loopback tunnel (``kvtransport.tier.tls``) that
        forwards over TLS to the tier; probes open TLS themselves."""
        from kvtransport.tier.tls import Forwarder, client_context
        self._tls_ctx = client_context(tls)           # ValueError for unreadable files or a loose key
        self._server_name = tls.server_name or self.host
        self._tunnel = Forwarder(("127.0.0.1", 0), (self.host, self.port), connect_tls=self._tls_ctx,
                                 server_name=self._server_name, handshake_timeout_s=self.timeout_s + 1.0,
                                 counts=self.tls_counts, name=f"kvnotes-tier-tls-{self.port}")
        self._engine.config.remote_url = self._tunnel.url    # read by LMCache's RemoteBackend

    def _status(self) -> str | None:
        """lm_server_status of the tier itself (over TLS when on), bounded by ``timeout_s``."""
        why = lm_server_status(self.host, self.port, self.timeout_s, self._key, self._tls_ctx,
                               self._server_name, self.tls_counts)
        if why is not None and self._tunnel is not None and self.tls_counts.last_error and "TLS" not in why:
            why = f"{why}; last TLS error: {self.tls_counts.last_error}"
        return why

    def _probe_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            why = self._status()   # outside the lock
            with self._lock:
                if self._stop.is_set():
                    return
                self.probes += 1
                if why is not None:
                    if why.startswith("refused"):
                        self.auth_refusals += 1
                    if self.up:
                        self._mark_down(f"probe: {why}")
                elif self.up and self._peer_closed():
                    self._mark_down("the server closed our connection (restarted?)")
                    self._try_attach()
                elif not self.up:
                    self._try_attach()

    def _peer_closed(self) -> bool:
        """True if the server closed the attached socket (read without consuming, non-blocking)."""
        try:
            sock = _client_socket(self._backend.connection.inner)
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False           # open, nothing to read: healthy
        except (OSError, RuntimeError, AttributeError):
            return True

    def _record(self, op: str, exc: BaseException) -> None:
        self.errors += 1
        self._last_op_error = f"{op}: {type(exc).__name__}: {exc}"
        self._failed.set()

    def _try_attach(self) -> None:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        from kvtransport.tier.auth import TierAuthError, client_handshake

        self._next_try = time.monotonic() + self.retry_s
        why = self._status()
        if why is not None:
            if why.startswith("refused"):
                self.auth_refusals += 1
            self._mark_down(why)
            return
        sm = self._engine.storage_manager
        be = RemoteBackend(self._engine.config, self._engine.metadata, sm.loop, sm.local_cpu_backend,
                           dst_device="cpu")
        if be.connection is None:
            self._mark_down("LMCache could not connect")
            return
        sock = _client_socket(be.connection)
        sock.settimeout(self.timeout_s)
        try:
            client_handshake(sock, self._key, f"{self.host}:{self.port}")
        except (TierAuthError, OSError) as exc:
            self._close_socket(be)
            if isinstance(exc, TierAuthError):
                self.auth_refusals += 1
            self._mark_down(f"{'refused: ' if isinstance(exc, TierAuthError) else ''}{exc}")
            return
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
        self.last_error = reason
        if not self._down_logged:
            if reason.startswith("refused"):
                log.error("remote KV tier %s refused this worker (%s): lookups miss and callers recompute; "
                          "retrying every %.1fs", self.url, reason, self.retry_s)
            else:
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
