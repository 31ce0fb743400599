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

Each forwarder runs its own asyncio event loop in one daemon thread and counts (``TlsCounts``):
connections forwarded, TLS handshakes failed by reason (``certificate``: a certificate refused
either way, ``protocol``: not TLS, e.g. plaintext to the TLS port, ``timeout``, ``closed``), and
targets it could not connect to. Key files other users may read are refused (:func:`checked_files`).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections import Counter
from pathlib import Path

from kvruntime.config.tier import TierTLS

log = logging.getLogger(__name__)

BUFFER_BYTES = 256 << 10         # one read of a forwarded stream (LMCache sends whole pieces, ~MBs)
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
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or "timed out" in text or "longer than" in text:
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
    Closing either end closes both. :meth:`close` stops the listener and every connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, accept_tls: ssl.SSLContext | None = None,
                 connect_tls: ssl.SSLContext | None = None, server_name: str | None = None,
                 handshake_timeout_s: float = 5.0, counts: TlsCounts | None = None, name: str = "kvnotes-tier-tls"):
        if (accept_tls is None) == (connect_tls is None):
            raise ValueError("a Forwarder has TLS on exactly one side (accept_tls or connect_tls)")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        self.target = target
        self._accept_tls, self._connect_tls = accept_tls, connect_tls
        self._server_name = server_name or target[0]
        self._timeout = handshake_timeout_s
        self.counts = counts if counts is not None else TlsCounts()
        self._tasks: set[asyncio.Task] = set()
        self._listener = socket.create_server(listen, reuse_port=False)     # SO_REUSEADDR on POSIX
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._accepting = asyncio.run_coroutine_threadsafe(self._accept_loop(), self._loop)
        self._closed = False

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, close every forwarded connection, stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout_s)
        except (TimeoutError, RuntimeError, asyncio.TimeoutError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
        self._listener.close()

    async def _shutdown(self) -> None:
        """Cancel the accept loop and every connection's task (all this loop runs but this)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as exc:      # e.g. EMFILE: counted, and the loop goes on after a pause
                self.counts.bump("accept_failures", f"accept: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handle(conn, addr))
            self._tasks.add(task)             # asyncio holds tasks weakly: an idle connection's would be collected
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, conn: socket.socket, addr) -> None:
        """One accepted connection: TLS accepted on it (terminator) or made to the target (tunnel)
        before anything else is read, so no TLS byte is buffered where the handshake cannot see it."""
        ins = out = None
        try:
            ins = await self._wrap_accepted(conn, f"{addr[0]}:{addr[1]}")
            if ins is None:
                return
            out = await self._dial()
            if out is None:
                return
            self.counts.bump("connections")
            await self._pipe(*ins, *out)
        except asyncio.CancelledError:
            pass
        finally:
            for streams in (ins, out):
                if streams is not None:
                    streams[1].close()
            if ins is None:
                conn.close()

    async def _wrap_accepted(self, conn: socket.socket, where: str):
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=4 * BUFFER_BYTES)
        protocol = asyncio.StreamReaderProtocol(reader)
        kw = {} if self._accept_tls is None else {"ssl": self._accept_tls, "ssl_handshake_timeout": self._timeout}
        try:
            transport, _ = await asyncio.wait_for(loop.connect_accepted_socket(lambda: protocol, conn, **kw),
                                                  self._timeout + 1.0)
        except (OSError, EOFError, asyncio.TimeoutError) as exc:
            log.debug("%s", self.counts.handshake_failed(exc, where))
            return None
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        host, port = self.target
        where = f"{host}:{port}"
        try:
            sock = await asyncio.wait_for(self._connect(host, port), self._timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self.counts.bump("connect_failures", f"cannot connect to {where}: {type(exc).__name__}: {exc}")
            return None
        kw = {} if self._connect_tls is None else {"ssl": self._connect_tls, "server_hostname": self._server_name,
                                                    "ssl_handshake_timeout": self._timeout}
        try:
            return await asyncio.wait_for(asyncio.open_connection(sock=sock, limit=4 * BUFFER_BYTES, **kw),
                                          self._timeout + 1.0)
        except (OSError, EOFError, asyncio.TimeoutError) as exc:
            sock.close()
            line = self.counts.handshake_failed(exc, where)
            log.debug("%s", line)
            return None

    @staticmethod
    async def _connect(host: str, port: int) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    async def _pipe(r1: asyncio.StreamReader, w1: asyncio.StreamWriter, r2: asyncio.StreamReader,
                    w2: asyncio.StreamWriter) -> None:
        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(BUFFER_BYTES):
                    dst.write(data)
                    await dst.drain()
            except (OSError, EOFError):
                pass
        legs = [asyncio.ensure_future(copy(r1, w2)), asyncio.ensure_future(copy(r2, w1))]
        try:
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)     # either end closed: close both
        finally:
            for leg in legs:
                leg.cancel()
            await asyncio.gather(*legs, return_exceptions=True)
