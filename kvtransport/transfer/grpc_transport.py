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

The stages live in modules of their own; this one joins them (:class:`GrpcTransport`, both
ends) and re-exports the names callers import from here: ``grpc_config`` (the typed
:class:`GrpcTransportConfig`, :func:`tune_malloc`), ``grpc_server`` (the receiving side:
``PushServicer`` admit -> read -> verify, ``start_server``, ``PUSH_METHOD``), ``grpc_client``
(the sending side: ``GrpcSender``, channels, refusal reasons), ``grpc_codec`` (the messages).
"""
from __future__ import annotations

from concurrent import futures

import grpc

from kvtransport.transfer.blocks import KVBlock, KVBlockHeader, Payload
from kvtransport.transfer.buffer_pool import BufferPool
from kvtransport.transfer.grpc_client import GrpcSender
from kvtransport.transfer.grpc_config import GrpcTransportConfig, tune_malloc
from kvtransport.transfer.grpc_server import PUSH_METHOD, PushServicer, start_server
from kvtransport.transfer.inbox import Inbox, InboxStats
from kvtransport.transfer.interface import KVTransport, TransferReceipt, TransferState
from kvtransport.transfer.stream_watch import HeaderWatch

__all__ = ["GrpcTransport", "GrpcTransportConfig", "PUSH_METHOD", "tune_malloc"]


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
        self._servicer: PushServicer | None = None
        self._watch: HeaderWatch | None = None
        self._server: grpc.Server | None = None
        # one CRC thread, in order, shared by this transport's sends and receives (cfg.crc_thread)
        self._crc_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="grpc-crc") if cfg.crc_thread else None
        self._sender = GrpcSender(cfg, self._crc_pool)
        self.port: int | None = None

    # ---- the receiving side (grpc_server) ----
    def serve(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None) -> str:
        """Start the receiving server (threads, a socket, the receive pool) bound to ``host``
        (``0.0.0.0``: all interfaces); returns the ``advertise:port`` address senders use
        (``advertise`` defaults to ``host``). Raises RuntimeError if it cannot be bound."""
        pool = BufferPool(self.cfg.pool_bytes) if self.cfg.pool_bytes else None
        c = self.cfg
        self._watch = HeaderWatch(c.first_message_timeout_s, c.max_waiting_streams_per_peer, c.max_waiting_streams)
        self._servicer = PushServicer(self._inbox, pool, self.model, self._crc_pool, c.checksum, self._watch)
        self._server, self.port = start_server(c, self._servicer, host, port)
        return f"{advertise or host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server (waits up to ``grace`` s for pushes in flight) and close channels."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._sender.stop()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)

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

    # ---- the sending side (grpc_client) ----
    def _push(self, address: str):
        return self._sender.push_stub(address)

    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        """Push ``block`` to the server at ``address``; blocks until the receiver has verified it
        (or refused it). Raises :class:`TransferError` with reason ``timeout``, ``unavailable``,
        ``backpressure``, ``duplicate``, ``too_large``, ``rejected`` or ``rpc_error``."""
        return self._sender.send(address, block, timeout=timeout)

    def send_kv(self, address: str, header: KVBlockHeader, payload: Payload, *, timeout: float = 30.0) -> TransferReceipt:
        """Stream ``payload`` (e.g. from :func:`~kvtransport.transfer.blocks.block_header`: it aliases the KV
        tensor, which must not change until this returns) under ``header`` (its checksum is
        ignored): each chunk is CRC'd as it is framed and the CRC-32C is sent last, so no CRC pass
        precedes the first byte; to a same-host ``address`` under ``checksum: "auto"``, no CRC at
        all (:meth:`checks`). Otherwise as :meth:`send` (same errors, same verification)."""
        return self._sender.send_kv(address, header, payload, timeout=timeout)

    def checks(self, address: str) -> bool:
        """Whether :meth:`send_kv` to ``address`` CRCs the block: always under ``checksum:
        "always"``, else unless ``address`` is on this host (an address that is not ``host:port``
        is not provably local: checked, and the push then fails as gRPC reports it)."""
        return self._sender.checks(address)
