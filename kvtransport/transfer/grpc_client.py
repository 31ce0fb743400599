"""The sending side of the gRPC transport (the prefill worker's pushes): :class:`GrpcSender`
keeps one channel per receiver address (TLS when the config says so) and pushes one block per
client stream, either an encoded block (:meth:`GrpcSender.send`) or a streamed one
(:meth:`GrpcSender.send_kv`: CRC'd chunk by chunk, or unchecked to a same-host receiver under
``checksum: "auto"``, falling back to CRC'd for a receiver that refuses it). A receiver's
refusal comes back as a :class:`~kvtransport.transfer.interface.TransferError` whose reason is
the ``[reason]`` leading the status details, else one read from the status code.
:class:`~kvtransport.transfer.grpc_transport.GrpcTransport` sends through one."""
from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import grpc

from kvtransport.transfer.blocks import KVBlock, KVBlockHeader, Payload
from kvtransport.transfer.grpc_codec import CrcChain, block_to_messages, stream_messages
from kvtransport.transfer.grpc_config import GrpcTransportConfig
from kvtransport.transfer.grpc_server import PUSH_METHOD
from kvtransport.transfer.interface import BlockSender, TransferError, TransferReceipt
from kvtransport.transfer.proto import kvtransfer_pb2 as pb
from kvtransport.transfer.same_host import address_host, is_local_host

log = logging.getLogger(__name__)

_REASON_PREFIX = re.compile(r"^\[([a-z_]+)\] ")   # the receiver's refusal reason leads its status details
_REASONS = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.RESOURCE_EXHAUSTED: "backpressure", grpc.StatusCode.ALREADY_EXISTS: "duplicate",
            grpc.StatusCode.FAILED_PRECONDITION: "too_large"}


class GrpcSender(BlockSender):
    """Pushes blocks to gRPC receivers. ``crc_pool``: the executor CRC-32C runs on (None: in
    line; shared with the transport's receiving side). Thread-safe: the channel map and the
    addresses that require a checksum are guarded by one lock."""

    def __init__(self, cfg: GrpcTransportConfig, crc_pool=None):
        self.cfg, self._crc_pool = cfg, crc_pool
        self._channels: dict[str, grpc.Channel] = {}
        self._checked_addresses: set[str] = set()       # receivers that refused an unchecked block
        self._lock = threading.Lock()

    def push_stub(self, address: str):
        """The Push call on ``address``'s channel (opened on first use, kept until :meth:`stop`)."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                creds, opts = self.cfg.channel_credentials(), self.cfg.channel_options()
                if creds is None:
                    ch = grpc.insecure_channel(address, options=opts)
                else:
                    name = self.cfg.tls_server_name
                    ch = grpc.secure_channel(address, creds, options=opts + (
                        [("grpc.ssl_target_name_override", name)] if name else []))
                self._channels[address] = ch
        return ch.stream_unary(PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)

    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        """See :meth:`GrpcTransport.send <kvtransport.transfer.grpc_transport.GrpcTransport.send>`."""
        return self._call(address, block.header.transfer_id, block_to_messages(block, self.cfg.chunk_bytes), timeout)

    def send_kv(self, address: str, header: KVBlockHeader, payload: Payload, *, timeout: float = 30.0) -> TransferReceipt:
        """See :meth:`GrpcTransport.send_kv <kvtransport.transfer.grpc_transport.GrpcTransport.send_kv>`."""
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
        """See :meth:`GrpcTransport.checks <kvtransport.transfer.grpc_transport.GrpcTransport.checks>`."""
        if self.cfg.checksum == "always" or address in self._checked_addresses:
            return True
        try:
            return not is_local_host(address_host(address))
        except ValueError:
            return True

    def _call(self, address: str, tid: str, messages, timeout: float) -> TransferReceipt:
        t = time.perf_counter()
        try:
            reply = self.push_stub(address)(messages, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            m = _REASON_PREFIX.match(exc.details() or "")
            raise TransferError(m.group(1) if m else _REASONS.get(code, "rpc_error"),
                                f"push of {tid} to {address} failed: {code.name}: {exc.details()}") from None
        if not reply.ok:
            raise TransferError("rejected", f"receiver rejected {tid}: {reply.error}")
        return TransferReceipt(tid, reply.bytes_received, time.perf_counter() - t)

    def stop(self) -> None:
        """Close every channel (a later send opens a fresh one)."""
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
