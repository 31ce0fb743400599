"""The gRPC KV inbox stays open for pushes with grants (issue 45, item 5), against a real gRPC
server: 8 idle streams that never send a header do not hold its threads (a granted push made
while they are open completes and is claimed); the idle streams are cancelled by the server
(one host's waiting streams bounded, a deadline for the first message), counted; a bogus 8 MiB
transfer id is refused and never logged whole. Waits are bounded by the transfer timeout."""
from __future__ import annotations

import logging
import threading

import grpc
import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import decode_block, encode_block
from kvtransport.transfer.grpc_codec import header_to_pb
from kvtransport.transfer.grpc_transport import PUSH_METHOD, GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.inbox import Inbox
from kvtransport.transfer.interface import TransferError
from kvtransport.transfer.proto import kvtransfer_pb2 as pb
from tests.conftest import wait_for

TRANSFER_TIMEOUT_S = 20.0


def _kv(tokens=40):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(2, 2, 2, tokens, 32, generator=g), torch.arange(tokens), torch.arange(100, 100 + tokens))


class _IdleStreams:
    """``n`` Push streams on their own channels that send nothing until released."""

    def __init__(self, address: str, n: int):
        self.release = threading.Event()
        self.channels = [grpc.insecure_channel(address) for _ in range(n)]

        def nothing():
            self.release.wait(TRANSFER_TIMEOUT_S)
            return
            yield  # pragma: no cover  (a generator that yields nothing)

        self.calls = [ch.stream_unary(PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)
                      .future(nothing(), timeout=TRANSFER_TIMEOUT_S) for ch in self.channels]

    def close(self):
        self.release.set()
        for c in self.calls:
            c.cancel()
        for ch in self.channels:
            ch.close()


def test_idle_streams_do_not_stall_a_granted_push():
    cfg = GrpcTransportConfig(require_grant=True, workers=8, pool_bytes=8 << 20, first_message_timeout_s=1.0)
    rx = GrpcTransport(cfg, model="m")
    addr = rx.serve("127.0.0.1")
    tx = GrpcTransport()
    idle = _IdleStreams(addr, 8)
    try:
        wait_for(lambda: rx.waiting_streams() + sum(rx.cancelled_streams().values()) >= 8, TRANSFER_TIMEOUT_S,
                 "the server to see the 8 idle streams", every=0.02)
        kv = _kv()
        grant, cred = TransferGrant.issue("granted-1", "m", "float32", kv.token_ids.tolist(), 0)
        rx.expect(grant)
        receipt = tx.send(addr, encode_block("granted-1", "m", kv, credential=cred), timeout=TRANSFER_TIMEOUT_S)
        assert receipt.seconds < TRANSFER_TIMEOUT_S
        assert torch.equal(decode_block(rx.receive("granted-1", timeout=5)).data, kv.data)
        # the idle streams end cancelled by the server: 4 of one host waiting at most, the rest past the deadline
        wait_for(lambda: all(c.done() for c in idle.calls), TRANSFER_TIMEOUT_S, "the idle streams to be cancelled")
        assert all(c.exception() is not None and c.exception().code() is grpc.StatusCode.CANCELLED for c in idle.calls)
        cancelled = rx.cancelled_streams()
        assert cancelled.get("stream_limit", 0) >= 4 and sum(cancelled.values()) >= 8, cancelled
        assert rx.waiting_streams() == 0
    finally:
        idle.close()
        tx.stop()
        rx.stop()


def test_an_8_mib_transfer_id_is_refused_and_logged_bounded(caplog):
    cfg = GrpcTransportConfig(require_grant=True, max_message_bytes=32 << 20, pool_bytes=0)
    rx = GrpcTransport(cfg, model="m")
    addr = rx.serve("127.0.0.1")
    bogus = "x" * (8 << 20)
    block = encode_block("placeholder", "m", _kv())
    header = header_to_pb(block.header, 1 << 20)
    header.transfer_id = bogus
    ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 32 << 20),
                                              ("grpc.max_receive_message_length", 32 << 20)])
    push = ch.stream_unary(PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)
    try:
        with caplog.at_level(logging.DEBUG):
            with pytest.raises(grpc.RpcError) as info:
                push(iter([pb.PushChunk(header=header).SerializeToString()]), timeout=TRANSFER_TIMEOUT_S)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and len(info.value.details()) < 1024
            assert "[bad_transfer_id]" in info.value.details()
            inbox = Inbox(1 << 20, 1 << 20, 60, require_grant=True)          # the NIXL path's refusal, too
            with pytest.raises(TransferError) as refused:
                inbox.begin(bogus, 10)
            assert refused.value.reason == "bad_transfer_id" and len(str(refused.value)) < 1024
        assert rx.stats().refused.get("bad_transfer_id") == 1
        logged = [r.getMessage() for r in caplog.records]
        assert any("8388608 chars" in m for m in logged), logged
        assert all(len(m) < 4096 for m in logged), max(map(len, logged))
    finally:
        ch.close()
        rx.stop()


def test_a_cancel_is_taken_only_from_the_peer_that_pushes():
    inbox = Inbox(1 << 20, 1 << 20, 60)
    inbox.begin("t1", 100, peer="agent-a")
    assert not inbox.abort("t1", "cancelled by sender agent-b", peer="agent-b")      # not its transfer
    assert inbox.stats().refused == {"foreign_cancel": 1} and inbox.stats().pending == 1
    assert inbox.abort("t1", "cancelled by sender agent-a", peer="agent-a")
    with pytest.raises(TransferError, match="aborted"):
        inbox.claim("t1", timeout=1)
