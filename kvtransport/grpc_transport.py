"""KV blocks over gRPC: the decode worker runs the server (an inbox of verified blocks), the
prefill worker pushes. One client stream per block: header, then bounded payload chunks.

Safety: max message size (chunk + header headroom), a deadline per push, a bounded inbox
(bytes) that refuses new pushes with RESOURCE_EXHAUSTED when full (backpressure towards the
prefill side), CRC-32 verification before a block is visible, and expiry of unclaimed blocks.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from kvtransport.blocks import BlockError, KVBlock, verify
from kvtransport.grpc_codec import ack, block_to_chunks, header_from_pb
from kvtransport.proto import kvtransfer_pb2_grpc as pb_grpc
from kvtransport.transport import KVTransport, TransferError, TransferReceipt, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrpcTransportConfig:
    chunk_bytes: int = 1 << 20            # payload bytes per stream message
    max_message_bytes: int = 8 << 20      # gRPC send/receive limit (must exceed chunk + header)
    max_block_bytes: int = 2 << 30        # a larger block is refused before its payload arrives
    inbox_bytes: int = 4 << 30            # verified-but-unclaimed bytes held before refusing pushes
    unclaimed_ttl_s: float = 300.0        # an unclaimed block is dropped after this long
    workers: int = 8                      # server threads (concurrent pushes)

    def __post_init__(self):
        if self.chunk_bytes <= 0 or self.max_message_bytes < self.chunk_bytes + (1 << 20):
            raise ValueError("max_message_bytes must exceed chunk_bytes by at least 1 MiB of header room")


class _Inbox:
    def __init__(self, cfg: GrpcTransportConfig):
        self.cfg = cfg
        self._cv = threading.Condition()
        self._blocks: dict[str, tuple[KVBlock, float]] = {}       # transfer_id -> (block, arrival time)
        self._state: dict[str, tuple[TransferState, str]] = {}    # transfer_id -> (state, error)
        self._bytes = 0

    def begin(self, tid: str, nbytes: int) -> str | None:
        with self._cv:
            self._expire()
            if nbytes > self.cfg.max_block_bytes:
                return f"block of {nbytes} bytes exceeds max_block_bytes {self.cfg.max_block_bytes}"
            if self._bytes + nbytes > self.cfg.inbox_bytes:
                return "inbox full"
            self._state[tid] = (TransferState.TRANSFERRING, "")
            return None

    def finish(self, tid: str, block: KVBlock | None, error: str = "") -> None:
        with self._cv:
            if block is None:
                self._state[tid] = (TransferState.FAILED, error)
            else:
                self._blocks[tid] = (block, time.monotonic())
                self._bytes += len(block.payload)
                self._state[tid] = (TransferState.DONE, "")
            self._cv.notify_all()

    def claim(self, tid: str, timeout: float) -> KVBlock:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                state, err = self._state.get(tid, (TransferState.PENDING, ""))
                if state is TransferState.DONE:
                    block, _ = self._blocks.pop(tid)
                    self._bytes -= len(block.payload)
                    del self._state[tid]
                    return block
                if state in (TransferState.FAILED, TransferState.ABORTED):
                    del self._state[tid]
                    raise TransferError("rejected", f"transfer {tid} {state.value}: {err}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError("timeout", f"transfer {tid} not received within {timeout:.1f} s")
                self._cv.wait(left)

    def state(self, tid: str) -> TransferState:
        with self._cv:
            return self._state.get(tid, (TransferState.PENDING, ""))[0]

    def _expire(self) -> None:
        now = time.monotonic()
        for tid, (block, t) in list(self._blocks.items()):
            if now - t > self.cfg.unclaimed_ttl_s:
                del self._blocks[tid]
                self._bytes -= len(block.payload)
                self._state[tid] = (TransferState.ABORTED, "expired unclaimed")
                log.warning("dropped unclaimed KV block %s after %.0f s", tid, self.cfg.unclaimed_ttl_s)


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, inbox: _Inbox, model: str | None):
        self.inbox, self.model = inbox, model

    def Push(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "header":
            return ack("", False, "stream must start with a header")
        header = header_from_pb(first.header)
        tid = header.transfer_id
        refused = self.inbox.begin(tid, header.payload_bytes)
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        parts, got = [], 0
        for msg in request_iterator:
            if msg.WhichOneof("item") != "payload":
                self.inbox.finish(tid, None, "second header in one stream")
                return ack(tid, False, "second header in one stream", got)
            got += len(msg.payload)
            if got > header.payload_bytes:
                self.inbox.finish(tid, None, "payload longer than announced")
                return ack(tid, False, "payload longer than announced", got)
            parts.append(msg.payload)
        block = KVBlock(header, b"".join(parts))
        try:
            verify(block, model=self.model)
        except BlockError as exc:
            log.warning("rejected KV block %s: %s", tid, exc)
            self.inbox.finish(tid, None, str(exc))
            return ack(tid, False, str(exc), got)
        self.inbox.finish(tid, block)
        return ack(tid, True, "", got)


class GrpcTransport(KVTransport):
    """Both ends of the gRPC transport. A decode worker calls :meth:`serve` once and then
    :meth:`receive`; a prefill worker only calls :meth:`send`."""

    def __init__(self, cfg: GrpcTransportConfig = GrpcTransportConfig(), *, model: str | None = None):
        self.cfg, self.model = cfg, model
        self._inbox = _Inbox(cfg)
        self._server: grpc.Server | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.port: int | None = None

    def _options(self):
        return [("grpc.max_send_message_length", self.cfg.max_message_bytes),
                ("grpc.max_receive_message_length", self.cfg.max_message_bytes)]

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the receiving server; returns its ``host:port`` address."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.cfg.workers), options=self._options())
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self._inbox, self.model), server)
        self.port = server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise RuntimeError(f"could not bind the KV transfer server to {host}:{port}")
        server.start()
        self._server = server
        return f"{host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _stub(self, address: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address, options=self._options())
        return pb_grpc.KVTransferStub(ch)

    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        t = time.perf_counter()
        try:
            reply = self._stub(address).Push(block_to_chunks(block, self.cfg.chunk_bytes), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            reason = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unavailable",
                      grpc.StatusCode.RESOURCE_EXHAUSTED: "backpressure"}.get(code, "rpc_error")
            raise TransferError(reason, f"push of {block.header.transfer_id} to {address} failed: "
                                        f"{code.name}: {exc.details()}") from None
        if not reply.ok:
            raise TransferError("rejected", f"receiver rejected {block.header.transfer_id}: {reply.error}")
        return TransferReceipt(block.header.transfer_id, reply.bytes_received, time.perf_counter() - t)

    def receive(self, transfer_id: str, *, timeout: float = 30.0) -> KVBlock:
        return self._inbox.claim(transfer_id, timeout)

    def state(self, transfer_id: str) -> TransferState:
        return self._inbox.state(transfer_id)
