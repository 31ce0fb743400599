"""The receiving side of the gRPC transport (the decode worker's server): :class:`PushServicer`
handles one ``Push`` stream per block in three stages, each refusing as early as it can:

1. admit (:meth:`PushServicer._admit`): the first message must be a header in time (the
   :class:`~kvtransport.transfer.stream_watch.HeaderWatch`); a too-long transfer id, an unchecked
   block from another host, or a transfer the inbox refuses (backpressure, duplicate, no grant,
   too large) is aborted with the reason leading the status details, before a byte is reserved;
2. read (:meth:`PushServicer._read_payload`): each chunk is copied once into its destination (a
   :class:`~kvtransport.transfer.buffer_pool.BufferPool` lease, or fresh memory, counted in
   ``pool_misses``) and CRC-32C'd while in cache;
3. verify: length and CRC-32C against the header or the stream's trailer; only then does the
   block become visible in the inbox.

:func:`start_server` binds the server a :class:`~kvtransport.transfer.grpc_transport.GrpcTransport`
runs. The wire messages are :mod:`kvtransport.transfer.grpc_codec`'s."""
from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent import futures

import grpc
import numpy as np

from kvtransport.transfer.blocks import BlockError, KVBlock, KVBlockHeader, as_bytes_array
from kvtransport.transfer.buffer_pool import BufferPool
from kvtransport.transfer.grpc_codec import CrcChain, Opening, Trailer, ack, parse_message
from kvtransport.transfer.grpc_config import GrpcTransportConfig
from kvtransport.transfer.inbox import MAX_TRANSFER_ID, Inbox, shown_id
from kvtransport.transfer.interface import TransferError
from kvtransport.transfer.proto import kvtransfer_pb2 as pb
from kvtransport.transfer.same_host import is_local_host, peer_host
from kvtransport.transfer.stream_watch import HeaderWatch

log = logging.getLogger(__name__)

PUSH_METHOD = "/kvnotes.kvtransfer.v1.KVTransfer/Push"
_CODES = {"backpressure": grpc.StatusCode.RESOURCE_EXHAUSTED, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
          "too_large": grpc.StatusCode.FAILED_PRECONDITION, "unknown_transfer": grpc.StatusCode.PERMISSION_DENIED,
          "bad_credential": grpc.StatusCode.PERMISSION_DENIED}


class PushServicer(grpc.GenericRpcHandler):
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
        layout = self._admit(header, unchecked, context)
        try:
            header.check(model=self.model)
        except BlockError as exc:
            log.warning("rejected KV block %s before its payload: %s", shown_id(tid), exc)
            self.inbox.finish(tid, None, str(exc))
            return ack(tid, False, str(exc))
        chain = None if unchecked else CrcChain(self.crc_pool)
        dest, got, claimed, error = self._read_payload(request_iterator, header, layout, checksum_last, chain)
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

    def _admit(self, header: KVBlockHeader, unchecked: bool, context):
        """Stage 1: begin the transfer in the inbox and return its row layout (None: dense), or
        abort the stream (``context.abort`` raises) with ``[reason]`` leading the details."""
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
            return self.inbox.begin(tid, header.payload_bytes, header, peer=context.peer())
        except TransferError as exc:
            context.abort(_CODES.get(exc.reason, grpc.StatusCode.FAILED_PRECONDITION), f"[{exc.reason}] {exc}")

    def _read_payload(self, request_iterator, header: KVBlockHeader, layout, checksum_last: bool,
                      chain: CrcChain | None):
        """Stage 2: the payload into its destination, CRC'd on ``chain`` (None: unchecked).
        Returns ``(dest, bytes received, claimed CRC or None, error or "")``."""
        got, error, claimed, dest = 0, "", None if checksum_last else header.checksum, None
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
        return dest, got, claimed, error

    def _takes_unchecked(self, peer: str) -> bool:
        """An unchecked block is taken under policy ``auto`` from a peer on this host only."""
        host = peer_host(peer)
        return self.checksum == "auto" and host is not None and is_local_host(host)


def start_server(cfg: GrpcTransportConfig, servicer: PushServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """Bind and start a server running ``servicer`` on ``host:port`` (TLS when ``cfg`` says so);
    returns it and the bound port. Raises RuntimeError if it cannot be bound."""
    threads = cfg.workers + cfg.max_waiting_streams        # streams waiting for a header never starve pushes
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-inbox"),
                         options=cfg.channel_options(), maximum_concurrent_rpcs=threads)
    server.add_generic_rpc_handlers((servicer,))
    creds = cfg.server_credentials()
    where = f"{host}:{port}"
    bound = server.add_secure_port(where, creds) if creds is not None else server.add_insecure_port(where)
    if not bound:
        raise RuntimeError(f"could not bind the KV transfer server to {host}:{port}")
    server.start()
    return server, bound
