"""TLS for the ``lm://`` tier, the way sidecars add it (stunnel, Envoy): around LMCache, not in it.

LMCache 0.5.6's ``lm://`` client writes with ``loop.sock_sendall`` on a raw socket (an
``ssl.SSLSocket`` is refused there) and its server reads plain sockets, so neither speaks TLS.
With ``tier_remote_tls_ca_file`` set:

- each prefill actor's :class:`~kvtransport.tier.lmcache_remote.RemoteTier` runs a
  :class:`Forwarder` *tunnel*: a listener on ``127.0.0.1`` (ephemeral port) that LMCache's client
  is pointed at; every connection it accepts is forwarded over TLS to the tier host, the server's
  certificate verified against the CA (and its name: ``tier_remote_tls_server_name`` or the URL's
  host), this actor's certificate presented when configured;
- the tier server (``kvtransport.tier.server``) runs a *terminator*: the TLS listener on the
  configured address, which requires a client certificate of the CA (unless
  ``tier_remote_tls_client_auth: false``) and forwards each connection to LMCache's server on a
  loopback port of its own.
The tier key's challenge-response (``kvtransport.tier.auth``) still runs end to end, inside TLS:
a local process that connects to the tunnel's loopback port gets a TLS connection to the tier but
no KV without the key. Its probes (``lm_server_status``) open TLS directly, without the tunnel.

Each forwarder runs an accept thread and one thread per connection, and counts (``TlsCounts``):
connections forwarded, TLS handshakes failed by reason (``certificate``: a certificate refused
either way, ``protocol``: not TLS, e.g. plaintext to the TLS port, ``timeout``, ``closed``), and
targets it could not connect to. Key files other users may read are refused (:func:`checked_files`).
"""
from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections import Counter
from pathlib import Path

from kvruntime.config.tier import TierTLS

log = logging.getLogger(__name__)

BUFFER_BYTES = 1 << 20           # one read of a forwarded stream (LMCache sends whole pieces, ~MBs)
FAILURE_REASONS = ("certificate", "protocol", "timeout", "closed")


def checked_files(tls: TierTLS, *, server: bool) -> dict[str, str]:
    """``{"ca": path, "cert": path, "key": path}`` (cert and key absent when not configured), each
    file read to check it is readable and not empty, a key that other users may read refused (the
    ``chmod`` named). ``server``: the tier server's end, which must present a certificate.
    ``ValueError`` naming the setting."""
    from kvruntime.private_files import looser_than_private
    if server and not tls.cert_file:
        raise ValueError("the lm:// tier server's TLS needs tier_remote_tls_cert_file and tier_remote_tls_key_file")
    out = {}
    for what, path in (("ca", tls.ca_file), ("cert", tls.cert_file), ("key", tls.key_file)):
        if path is None:
            continue
        p = Path(path).expanduser()
        try:
            with open(p, "rb") as f:
                empty = not f.read(1)
        except OSError as exc:
            raise ValueError(f"tier_remote_tls_{what}_file: cannot read {p}: {exc.strerror or exc}") from None
        if empty:
            raise ValueError(f"tier_remote_tls_{what}_file: {p} is empty")
        if what == "key" and (why := looser_than_private(p)) is not None:
            raise ValueError(f"tier_remote_tls_key_file: {why}")
        out[what] = str(p)
    return out


def client_context(tls: TierTLS) -> ssl.SSLContext:
    """What a prefill actor (and a probe) dials with: TLS >= 1.2, the server's certificate and
    name verified against the CA, this end's certificate presented when configured."""
    files = checked_files(tls, server=False)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if "cert" in files:
        ctx.load_cert_chain(files["cert"], files["key"])
    return ctx


def server_context(tls: TierTLS) -> ssl.SSLContext:
    """What the tier server's terminator accepts with: its certificate; a client certificate of
    the CA required unless ``client_auth`` is off."""
    files = checked_files(tls, server=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files["cert"], files["key"])
    ctx.load_verify_locations(cafile=files["ca"])
    ctx.verify_mode = ssl.CERT_REQUIRED if tls.client_auth else ssl.CERT_NONE
    return ctx


def failure_reason(exc: BaseException) -> str:
    """One of ``FAILURE_REASONS`` for an exception from a TLS handshake."""
    text = str(exc).lower()
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate" in text or "unknown ca" in text:
        return "certificate"
    if isinstance(exc, TimeoutError) or "timed out" in text or "longer than" in text:
        return "timeout"
    if isinstance(exc, ssl.SSLError):
        return "protocol"
    return "closed"


class TlsCounts:
    """Thread-safe counters of one end: ``connections``, ``handshake_failures:<reason>``,
    ``connect_failures`` (the forward target did not answer)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self.last_error = ""

    def bump(self, name: str, error: str = "") -> None:
        with self._lock:
            self._c[name] += 1
            if error:
                self.last_error = error

    def handshake_failed(self, exc: BaseException, where: str) -> str:
        """Count a failed handshake; returns the one-line reason recorded."""
        reason = failure_reason(exc)
        line = f"TLS handshake with {where} failed ({reason}): {type(exc).__name__}: {exc}"
        self.bump(f"handshake_failures:{reason}", line)
        return line

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    @property
    def connections(self) -> int:
        with self._lock:
            return self._c["connections"]

    @property
    def handshake_failures(self) -> int:
        with self._lock:
            return sum(v for k, v in self._c.items() if k.startswith("handshake_failures:"))


class Forwarder:
    """One TCP listener; every connection it accepts is forwarded to ``target``, with TLS on the
    accepting side (``accept_tls``: a terminator) or the dialling side (``connect_tls``: a tunnel).
    An accept thread and one thread per connection, OpenSSL en/decrypting on the sockets with the
    GIL released (asyncio's TLS streams, tried first, were no faster on a loaded 2-core machine,
    median 0.040 vs 0.051 GB/s, and hold an idle connection's task only weakly). Closing either
    end closes both; :meth:`close` stops the listener and every connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, accept_tls: ssl.SSLContext | None = None,
                 connect_tls: ssl.SSLContext | None = None, server_name: str | None = None,
                 handshake_timeout_s: float = 5.0, counts: TlsCounts | None = None, name: str = "kvnotes-tier-tls"):
        if (accept_tls is None) == (connect_tls is None):
            raise ValueError("a Forwarder has TLS on exactly one side (accept_tls or connect_tls)")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        self.target, self.name = target, name
        self._accept_tls, self._connect_tls = accept_tls, connect_tls
        self._server_name = server_name or target[0]
        self._timeout = handshake_timeout_s
        self.counts = counts if counts is not None else TlsCounts()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()          # every socket of a live connection (closed by close())
        self._closed = False
        self._listener = socket.create_server(listen)   # SO_REUSEADDR on POSIX
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening and close every forwarded connection (their threads end). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = list(self._open)
        for s in [self._listener, *socks]:
            _shut(s)
        self._listener.close()
        self._acceptor.join(timeout=timeout_s)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                self.counts.bump("accept_failures", f"accept: {type(exc).__name__}: {exc}")   # e.g. EMFILE
                time.sleep(0.1)
                continue
            threading.Thread(target=self._handle, args=(conn, f"{addr[0]}:{addr[1]}"), daemon=True,
                             name=f"{self.name}-conn").start()

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._open.update(socks)
            return True

    def _handle(self, conn: socket.socket, where: str) -> None:
        """One accepted connection: TLS accepted on it (terminator) or made to the target (tunnel),
        then both directions copied until either ends."""
        raw, out = conn, None
        try:
            if not self._track(raw):
                return
            if self._accept_tls is not None:
                conn = self._handshake(raw, self._accept_tls, where, server_side=True)
                if conn is None or not self._track(conn):
                    return
            out = self._dial()
            if out is None or not self._track(out):
                return
            self.counts.bump("connections")
            _relay(conn, out)
        finally:
            with self._lock:
                self._open.difference_update(s for s in (raw, conn, out) if s is not None)
            for s in (raw, conn, out):
                if s is not None:
                    s.close()

    def _handshake(self, sock: socket.socket, ctx: ssl.SSLContext, where: str, *, server_side: bool,
                   server_name: str | None = None) -> ssl.SSLSocket | None:
        sock.settimeout(self._timeout)
        try:
            tls = ctx.wrap_socket(sock, server_side=server_side, server_hostname=server_name)
        except (OSError, EOFError) as exc:
            log.debug("%s", self.counts.handshake_failed(exc, where))
            sock.close()
            return None
        tls.settimeout(None)
        return tls

    def _dial(self) -> socket.socket | None:
        host, port = self.target
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=self._timeout)
        except OSError as exc:
            self.counts.bump("connect_failures", f"cannot connect to {where}: {type(exc).__name__}: {exc}")
            return None
        if self._connect_tls is None:
            sock.settimeout(None)
            return sock
        return self._handshake(sock, self._connect_tls, where, server_side=False, server_name=self._server_name)


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways between a plain and a TLS socket, in this one thread (an ``SSLSocket`` must
    not be read and written by two threads at once), until either ends or fails; then shut both.
    The TLS side is read non-blocking (a record that is not application data, e.g. a session
    ticket, must not block the other direction) and written blocking."""
    tls_side = a if isinstance(a, ssl.SSLSocket) else b
    other = {a: b, b: a}
    buf = bytearray(BUFFER_BYTES)
    view = memoryview(buf)
    poller = select.poll()
    for s in (a, b):
        poller.register(s, select.POLLIN)
    tls_side.setblocking(False)
    try:
        while True:
            if tls_side.pending():
                ready = [tls_side]
            else:
                fds = {fd for fd, _ in poller.poll()}
                ready = [s for s in (a, b) if s.fileno() in fds]
            for src in ready:
                n, ended = _fill(src, view, src is tls_side)
                if n == 0 and ended:
                    return
                dst = other[src]
                if dst is tls_side:
                    dst.setblocking(True)
                    dst.sendall(view[:n])
                    dst.setblocking(False)
                else:
                    dst.sendall(view[:n])
                if ended:
                    return
    except (OSError, ValueError):
        pass
    finally:
        _shut(a)
        _shut(b)


def _fill(src: socket.socket, view: memoryview, drain: bool) -> tuple[int, bool]:
    """Read what ``src`` has into ``view``: one ``recv`` from a plain socket (poll said readable),
    or, from the non-blocking TLS side, records until none is complete or ``view`` is full (one
    ``sendall`` of many 16 KiB records). Returns (bytes read, whether ``src`` ended)."""
    n = 0
    while n < len(view):
        try:
            k = src.recv_into(view[n:])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return n, False
        if not k:
            return n, True
        n += k
        if not drain:
            break
    return n, False


def _shut(sock: socket.socket) -> None:
    """Shut a socket down both ways (wakes a thread blocked in accept or recv on it); never raises."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass
