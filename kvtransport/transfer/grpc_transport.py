"""KV blocks over gRPC: the decode worker runs the server (an inbox of verified blocks), the
prefill worker pushes. One client stream per block: header, then bounded payload chunks.

Copies per block (the portable path; NIXL is the fast one):
- send: :meth:`GrpcTransport.send` sends an encoded block (:func:`~kvtransport.transfer.blocks.encode_block`
  aliases the tensor and runs one CRC pass over it); each chunk is one copy of a slice into the
  ``bytes`` gRPC's Python API demands (``cygrpc.SendMessageOperation`` refuses memoryviews; gRPC
  core then copies it to a slice). :meth:`GrpcTransport.send_kv` streams the tensor's bytes
  instead, each chunk CRC'd from that fresh copy while it is in cache and the CRC sent last (no
  pass over the tensor before the first byte moves; whole-path GB/s measured the same on 2 cores).
- receive: gRPC hands each message over as ``bytes``; the header-free view of it is copied once
  into the block's destination, a lease of a :class:`~kvtransport.transfer.buffer_pool.BufferPool` arena
  (warm pages: a fresh 360 MiB allocation page-faults at 0.6-3 GB/s on the dev machine), and
  CRC-32C'd while in cache. A pool that cannot fit the block falls back to fresh memory
  (counted in ``pool_misses``, logged once).
Integrity: TCP's 16-bit checksum is too weak for 100s of MiB across hosts, so the payload's
CRC-32C (header, or the stream's last message) is checked before a block becomes visible;
``decode_block`` checks it again on the claimer unless the transport did. Between two processes
of one host nothing but the kernel's memory copies lies on the path, so under ``checksum:
"auto"`` (the default) :meth:`GrpcTransport.send_kv` to a same-host address sends the block
``unchecked`` (no CRC pass on either side: the two passes were most of the gap to bare gRPC,
docs/benchmarks.md), and the receiver accepts an unchecked block only from a peer on its own
host (:mod:`kvtransport.transfer.same_host`; counted in ``InboxStats.unchecked``), refusing any other
before a byte is reserved (reason ``checksum_required``; the sender then sends that block and
every later one to that address CRC'd, reported as fallback ``kv_grpc_checksum_required``).
``"always"`` checks every block.

Safety: max message size (chunk + header headroom), a deadline per push, a bounded inbox
(bytes) that refuses new pushes with RESOURCE_EXHAUSTED when full (backpressure towards the
prefill side), a transfer id accepted once (ALREADY_EXISTS), and expiry of unclaimed blocks.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from kvtransport.transfer.blocks import BlockError, KVBlock, KVBlockHeader, Payload, as_bytes_array
from kvtransport.transfer.grpc_codec import CrcChain, Opening, Trailer, ack, block_to_messages, parse_message, stream_messages
from kvtransport.transfer.proto import kvtransfer_pb2 as pb
from kvtransport.transfer.same_host import address_host, is_local_host, peer_host
from kvtransport.transfer.buffer_pool import BufferPool
from kvtransport.transfer.inbox import MAX_TRANSFER_ID, Inbox, InboxStats, shown_id
from kvtransport.transfer.stream_watch import HeaderWatch
from kvtransport.transfer.interface import KVTransport, TransferError, TransferReceipt, TransferState

log = logging.getLogger(__name__)

PUSH_METHOD = "/kvnotes.kvtransfer.v1.KVTransfer/Push"
_CODES = {"backpressure": grpc.StatusCode.RESOURCE_EXHAUSTED, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
          "too_large": grpc.StatusCode.FAILED_PRECONDITION, "unknown_transfer": grpc.StatusCode.PERMISSION_DENIED,
          "bad_credential": grpc.StatusCode.PERMISSION_DENIED}
_REASON_PREFIX = re.compile(r"^\[([a-z_]+)\] ")   # the receiver's refusal reason leads its status details
_REASONS = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.RESOURCE_EXHAUSTED: "backpressure", grpc.StatusCode.ALREADY_EXISTS: "duplicate",
            grpc.StatusCode.FAILED_PRECONDITION: "too_large"}


@dataclass(frozen=True)
class GrpcTransportConfig:
    chunk_bytes: int = 1 << 20            # payload bytes per stream message (1-8 MiB measured alike; 1 MiB)
    max_message_bytes: int = 8 << 20      # gRPC send/receive limit (must exceed chunk + header)
    max_block_bytes: int = 2 << 30        # a larger block is refused before its payload arrives
    inbox_bytes: int = 4 << 30            # in-flight + verified-but-unclaimed bytes before refusing pushes
    unclaimed_ttl_s: float = 300.0        # an unclaimed block is dropped after this long
    workers: int = 8                      # server threads (concurrent pushes)
    pool_bytes: int = 1 << 30             # receive arena (virtual until used; pages stay warm)
    require_grant: bool = False           # accept only transfers announced by expect() (the cluster: True)
    # glibc malloc: keep up to this many freed bytes in the heap (and serve allocations up to 32 MiB
    # from it) so gRPC's per-message buffers reuse warm pages instead of page-faulting fresh ones
    # (measured 0.75 -> 1.0-1.15 GB/s at 180 MiB); process-wide, set once; 0 leaves glibc's defaults
    malloc_keep_bytes: int = 256 << 20
    # CRC-32C of each chunk on one CRC thread per transport (sender's send_kv and receiver),
    # overlapping the stream (libcrc32c releases the GIL); False: in line, right after the chunk's
    # copy (in cache). On 2 cores in line measured faster (1.26-1.32 vs 0.91-0.99 GB/s at 180 MiB:
    # a hand-off per 1 MiB chunk costs more CPU than the overlap saves; docs/benchmarks.md)
    crc_thread: bool = False
    # HTTP/2 SETTINGS_MAX_FRAME_SIZE this side advertises (16 KiB .. 16 MiB - 1; 0: gRPC's default,
    # 16 KiB): larger DATA frames from the peer mean fewer slices per message to join
    http2_max_frame_bytes: int = 0
    # gRPC's TCP read buffer size hint (grpc.experimental.tcp_read_chunk_size; 0: gRPC's default)
    tcp_read_chunk_bytes: int = 0
    # HTTP/2 stream flow-control lookahead (grpc.http2.lookahead_bytes: how far a sender may run
    # ahead of the receiver's reads; 0: gRPC's default, 64 KiB, grown by BDP probing)
    http2_lookahead_bytes: int = 0
    # "auto": no CRC-32C for a same-host peer (send_kv sends such blocks unchecked; the receiver
    # takes unchecked blocks only from its own host); "always": every block is CRC-checked
    checksum: str = "auto"
    # a stream must send its header within this many seconds, at most this many streams of one host (and
    # of all hosts) wait for theirs; the server runs workers + max_waiting_streams threads
    # (kvtransport.transfer.stream_watch: idle streams cannot hold the inbox)
    first_message_timeout_s: float = 2.0
    max_waiting_streams_per_peer: int = 4
    max_waiting_streams: int = 32
    # TLS (across hosts): the server presents tls_cert_file / tls_key_file; senders verify it against
    # tls_ca_file (tls_server_name: the name the certificate carries, when not the dialled host), and
    # with tls_client_auth the server requires the senders' certificate too (the same files on every actor)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_server_name: str = ""
    tls_client_auth: bool = True

    def __post_init__(self):
        if self.checksum not in ("auto", "always"):
            raise ValueError(f"checksum must be 'auto' or 'always', got {self.checksum!r}")
        if self.chunk_bytes <= 0 or self.max_message_bytes < self.chunk_bytes + (1 << 20):
            raise ValueError("max_message_bytes must exceed chunk_bytes by at least 1 MiB of header room")
        if self.pool_bytes < 0 or self.malloc_keep_bytes < 0:
            raise ValueError("pool_bytes and malloc_keep_bytes must be >= 0 (0: no pool / glibc defaults)")
        if self.http2_max_frame_bytes and not (1 << 14) <= self.http2_max_frame_bytes < (1 << 24):
            raise ValueError("http2_max_frame_bytes must be 0 (default) or in [16384, 16777215] (HTTP/2 limits)")
        if self.tcp_read_chunk_bytes < 0 or self.http2_lookahead_bytes < 0:
            raise ValueError("tcp_read_chunk_bytes and http2_lookahead_bytes must be >= 0 (0: gRPC's default)")
        if self.first_message_timeout_s <= 0 or not 1 <= self.max_waiting_streams_per_peer <= self.max_waiting_streams:
            raise ValueError("first_message_timeout_s must be > 0 and 1 <= max_waiting_streams_per_peer <= "
                             "max_waiting_streams")
        if bool(self.tls_cert_file) != bool(self.tls_key_file) or (self.tls_cert_file and not self.tls_ca_file):
            raise ValueError("TLS needs tls_cert_file, tls_key_file and tls_ca_file together (or none of them)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def _read(self, name: str) -> bytes:
        from pathlib import Path
        path = getattr(self, name)
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None

    def server_credentials(self):
        """gRPC server credentials for TLS (None: plain)."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self._read("tls_key_file"), self._read("tls_cert_file"))],
                                           root_certificates=self._read("tls_ca_file"),
                                           require_client_auth=self.tls_client_auth)

    def channel_credentials(self):
        """gRPC channel credentials for TLS (None: plain): the CA, and this actor's own certificate."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self._read("tls_ca_file"),
                                            private_key=self._read("tls_key_file"),
                                            certificate_chain=self._read("tls_cert_file"))

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel/server arguments for this config (both ends use them)."""
        opts = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        if self.http2_max_frame_bytes:
            opts.append(("grpc.http2.max_frame_size", self.http2_max_frame_bytes))
        if self.http2_lookahead_bytes:
            opts.append(("grpc.http2.lookahead_bytes", self.http2_lookahead_bytes))
        if self.tcp_read_chunk_bytes:
            opts += [("grpc.experimental.tcp_read_chunk_size", self.tcp_read_chunk_bytes),
                     ("grpc.experimental.tcp_max_read_chunk_size", max(self.tcp_read_chunk_bytes, 4 << 20))]
        return opts


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # mallopt(3) parameters
_malloc_tuned = False


def tune_malloc(keep_bytes: int) -> bool:
    """Once per process: glibc ``mallopt`` so that freed message buffers stay in the heap (trim
    threshold ``keep_bytes``) and allocations up to 32 MiB (glibc's maximum mmap threshold) come
    from it, warm, instead of a fresh ``mmap`` that page-faults per 4 KiB. Returns whether it
    applied (False: not glibc, ``keep_bytes`` 0, or already done); logged."""
    global _malloc_tuned
    if _malloc_tuned or keep_bytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, keep_bytes) == 1
    except (OSError, AttributeError):  # not glibc (musl, macOS): defaults stay, logged
        ok = False
    _malloc_tuned = True
    log.info("gRPC transport: malloc keeps up to %d freed bytes warm: %s", keep_bytes, "applied" if ok else "unavailable")
    return ok


class _Servicer(grpc.GenericRpcHandler):
    """The Push handler on raw bytes (see grpc_codec). Mutates the inbox and the pool."""

    def __init__(self, inbox: Inbox, pool: BufferPool | None, model: str | None, crc_pool, checksum: str = "auto",
                 watch: HeaderWatch | None = None):
        self.inbox, self.pool, self.model, self.crc_pool, self.checksum = inbox, pool, model, crc_pool, checksum
        self.watch = watch
        self.pool_misses = 0
        self._lock = threading.Lock()

    def _first(self, request_iterator, context):
        """The stream's first message, or None (it ended, or the watch cancelled it: no header in
        time, or one stream too many of its host waiting)."""
        token = self.watch.enter(peer_host(context.peer()) or context.peer(), context) if self.watch else None
        try:
            return next(request_iterator, None)
        except Exception:              # cancelled (grpc.RpcError): counted by the watch
            return None
        finally:
            if token is not None:
                self.watch.leave(token)

    def service(self, details):
        if details.method != PUSH_METHOD:
            return None
        return grpc.stream_unary_rpc_method_handler(self.push, request_deserializer=None,
                                                    response_serializer=pb.PushAck.SerializeToString)

    def _destination(self, nbytes: int) -> np.ndarray:
        view = self.pool.lease(nbytes) if self.pool is not None and nbytes else None
        if view is None:
            with self._lock:
                self.pool_misses += 1
                first = self.pool_misses == 1
            if first and self.pool is not None:
                log.warning("KV receive pool (%d bytes, %d leased) cannot fit %d bytes: fresh memory "
                            "(counted in pool_misses; logged once)", self.pool.nbytes, self.pool.leased_bytes, nbytes)
            return np.empty(nbytes, dtype=np.uint8)
        return view

    def push(self, request_iterator, context):
        first = self._first(request_iterator, context)
        try:
            opening = parse_message(first) if first is not None else None
        except ValueError:
            opening = None
        if not isinstance(opening, Opening):
            return ack("", False, "stream must start with a header")
        header, checksum_last, unchecked = opening
        tid = header.transfer_id
        if len(tid) > MAX_TRANSFER_ID:            # before anything logs it or echoes it back
            self.inbox.refuse(tid, "bad_transfer_id", f"transfer id of {len(tid)} characters from {context.peer()}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"[bad_transfer_id] transfer id {shown_id(tid)} is longer than {MAX_TRANSFER_ID} characters")
        if unchecked and not self._takes_unchecked(context.peer()):
            msg = (f"block without a checksum from {context.peer()}: this receiver takes unchecked blocks only from "
                   f"its own host under checksum policy 'auto' (its policy: {self.checksum!r})")
            self.inbox.refuse(tid, "checksum_required", msg)       # before begin: the grant stays for the retry
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"[checksum_required] {msg}")
        try:
            layout = self.inbox.begin(tid, header.payload_bytes, header, peer=context.peer())
        except TransferError as exc:
            context.abort(_CODES.get(exc.reason, grpc.StatusCode.FAILED_PRECONDITION), f"[{exc.reason}] {exc}")
        try:
            header.check(model=self.model)
        except BlockError as exc:
            log.warning("rejected KV block %s before its payload: %s", shown_id(tid), exc)
            self.inbox.finish(tid, None, str(exc))
            return ack(tid, False, str(exc))
        got, error, claimed = 0, "", None if checksum_last else header.checksum
        chain = None if unchecked else CrcChain(self.crc_pool)
        try:
            dest = self._destination(header.payload_bytes if layout is None else layout.nbytes)
            for data in request_iterator:
                piece = parse_message(data)
                if isinstance(piece, Trailer) and checksum_last and claimed is None:
                    claimed = piece.checksum
                    continue
                if not isinstance(piece, memoryview) or (checksum_last and claimed is not None):
                    error = ("message after the checksum" if checksum_last and claimed is not None else
                             "unexpected checksum message" if isinstance(piece, Trailer) else
                             "second header in one stream" if piece is not None else "empty message")
                    break
                n = len(piece)
                if got + n > header.payload_bytes:
                    error, got = "payload longer than announced", got + n
                    break
                if layout is None:
                    dest[got:got + n] = as_bytes_array(piece)
                    written = (dest[got:got + n],)
                else:                            # rows land ``layout.capacity`` slots apart (room after each)
                    written = layout.put(dest, got, as_bytes_array(piece))
                for part in written if chain is not None else ():
                    chain.add(part)
                got += n
        except Exception as exc:  # a broken stream (client cancelled, deadline): the transfer fails, logged
            error = f"stream broken after {got} bytes: {type(exc).__name__}: {exc}"
        if not error and got != header.payload_bytes:
            error = f"payload is {got} bytes, header says {header.payload_bytes}"
        if not error and claimed is None and not unchecked:
            error = "stream ended without its checksum"
        crc = chain.result() if not error and chain is not None else 0
        if not error and not unchecked and crc != claimed:
            error = f"checksum mismatch: header {claimed:#010x}, payload {crc:#010x}"
        if error:
            log.warning("rejected KV block %s: %s", shown_id(tid), error)
            self.inbox.finish(tid, None, error)
            return ack(tid, False, error, got)
        if checksum_last:
            header = dataclasses.replace(header, checksum=crc)
        self.inbox.finish(tid, KVBlock.verified(header, memoryview(dest), layout), unchecked=unchecked)
        return ack(tid, True, "", got)

    def _takes_unchecked(self, peer: str) -> bool:
        """An unchecked block is taken under policy ``auto`` from a peer on this host only."""
        host = peer_host(peer)
        return self.checksum == "auto" and host is not None and is_local_host(host)


class GrpcTransport(KVTransport):
    """Both ends of the gRPC transport. A decode worker calls :meth:`serve` once and then
    :meth:`receive`; a prefill worker only calls :meth:`send`."""
    kind = "grpc"

    def __init__(self, cfg: GrpcTransportConfig = GrpcTransportConfig(), *, model: str | None = None,
                 inbox: Inbox | None = None):
        self.cfg, self.model = cfg, model
        tune_malloc(cfg.malloc_keep_bytes)
        self._inbox = inbox or Inbox(cfg.inbox_bytes, cfg.max_block_bytes, cfg.unclaimed_ttl_s,
                                     require_grant=cfg.require_grant)
        self._servicer: _Servicer | None = None
        self._watch: HeaderWatch | None = None
        self._server: grpc.Server | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._checked_addresses: set[str] = set()       # receivers that refused an unchecked block
        self._lock = threading.Lock()
        # one CRC thread, in order, shared by this transport's sends and receives (cfg.crc_thread)
        self._crc_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="grpc-crc") if cfg.crc_thread else None
        self.port: int | None = None

    def _options(self):
        return self.cfg.channel_options()

    def serve(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None) -> str:
        """Start the receiving server (threads, a socket, the receive pool) bound to ``host``
        (``0.0.0.0``: all interfaces); returns the ``advertise:port`` address senders use
        (``advertise`` defaults to ``host``). Raises RuntimeError if it cannot be bound."""
        pool = BufferPool(self.cfg.pool_bytes) if self.cfg.pool_bytes else None
        c = self.cfg
        self._watch = HeaderWatch(c.first_message_timeout_s, c.max_waiting_streams_per_peer, c.max_waiting_streams)
        self._servicer = _Servicer(self._inbox, pool, self.model, self._crc_pool, c.checksum, self._watch)
        threads = c.workers + c.max_waiting_streams        # streams waiting for a header never starve pushes
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-inbox"),
                             options=self._options(), maximum_concurrent_rpcs=threads)
        server.add_generic_rpc_handlers((self._servicer,))
        creds = c.server_credentials()
        where = f"{host}:{port}"
        self.port = server.add_secure_port(where, creds) if creds is not None else server.add_insecure_port(where)
        if not self.port:
            raise RuntimeError(f"could not bind the KV transfer server to {host}:{port}")
        server.start()
        self._server = server
        return f"{advertise or host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server (waits up to ``grace`` s for pushes in flight) and close channels."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)

    def _push(self, address: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                creds, opts = self.cfg.channel_credentials(), self._options()
                if creds is None:
                    ch = grpc.insecure_channel(address, options=opts)
                else:
                    name = self.cfg.tls_server_name
                    ch = grpc.secure_channel(address, creds, options=opts + (
                        [("grpc.ssl_target_name_override", name)] if name else []))
                self._channels[address] = ch
        return ch.stream_unary(PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)

    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        """Push ``block`` to the server at ``address``; blocks until the receiver has verified it
        (or refused it). Raises :class:`TransferError` with reason ``timeout``, ``unavailable``,
        ``backpressure``, ``duplicate``, ``too_large``, ``rejected`` or ``rpc_error``."""
        return self._call(address, block.header.transfer_id, block_to_messages(block, self.cfg.chunk_bytes), timeout)

    def send_kv(self, address: str, header: KVBlockHeader, payload: Payload, *, timeout: float = 30.0) -> TransferReceipt:
        """Stream ``payload`` (e.g. from :func:`~kvtransport.transfer.blocks.block_header`: it aliases the KV
        tensor, which must not change until this returns) under ``header`` (its checksum is
        ignored): each chunk is CRC'd as it is framed and the CRC-32C is sent last, so no CRC pass
        precedes the first byte; to a same-host ``address`` under ``checksum: "auto"``, no CRC at
        all (:meth:`checks`). Otherwise as :meth:`send` (same errors, same verification)."""
        def push(chain):
            return self._call(address, header.transfer_id,
                              stream_messages(header, payload, self.cfg.chunk_bytes, chain), timeout)

        if self.checks(address):
            return push(CrcChain(self._crc_pool))
        try:
            return push(None)
        except TransferError as exc:
            if exc.reason != "checksum_required":
                raise
        # the receiver does not count us as its own host (or checks every block): CRC from now on
        with self._lock:
            self._checked_addresses.add(address)
        log.warning("KV receiver %s refused an unchecked block: sending it CRC-32C'd, and every later block to it "
                    "(counted as fallback kv_grpc_checksum_required)", address)
        return dataclasses.replace(push(CrcChain(self._crc_pool)), fallback="kv_grpc_checksum_required")

    def checks(self, address: str) -> bool:
        """Whether :meth:`send_kv` to ``address`` CRCs the block: always under ``checksum:
        "always"``, else unless ``address`` is on this host (an address that is not ``host:port``
        is not provably local: checked, and the push then fails as gRPC reports it)."""
        if self.cfg.checksum == "always" or address in self._checked_addresses:
            return True
        try:
            return not is_local_host(address_host(address))
        except ValueError:
            return True

    def _call(self, address: str, tid: str, messages, timeout: float) -> TransferReceipt:
        t = time.perf_counter()
        try:
            reply = self._push(address)(messages, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            m = _REASON_PREFIX.match(exc.details() or "")
            raise TransferError(m.group(1) if m else _REASONS.get(code, "rpc_error"),
                                f"push of {tid} to {address} failed: {code.name}: {exc.details()}") from None
        if not reply.ok:
            raise TransferError("rejected", f"receiver rejected {tid}: {reply.error}")
        return TransferReceipt(tid, reply.bytes_received, time.perf_counter() - t)

    def receive(self, transfer_id: str, *, timeout: float = 30.0) -> KVBlock:
        """Claim a verified block (see :class:`KVTransport`); its payload leases pool memory
        until the block and every tensor decoded from it are dropped."""
        return self._inbox.claim(transfer_id, timeout)

    def expect(self, grant) -> None:
        """Announce a transfer (see :meth:`Inbox.expect`)."""
        self._inbox.expect(grant)

    def state(self, transfer_id: str) -> TransferState:
        return self._inbox.state(transfer_id)

    def waiting_streams(self) -> int:
        """Streams open on the server that have not sent their header yet."""
        return self._watch.waiting() if self._watch is not None else 0

    def cancelled_streams(self) -> dict:
        """Streams the server cancelled before their header, by reason (``no_header``, ``stream_limit``)."""
        return dict(self._watch.cancelled) if self._watch is not None else {}

    def stats(self) -> InboxStats:
        """Inbox accounting (held bytes, expiries, refusals by reason). Reads only."""
        return self._inbox.stats()

    @property
    def pool_misses(self) -> int:
        """Blocks received into fresh memory because the pool could not fit them."""
        return self._servicer.pool_misses if self._servicer is not None else 0

