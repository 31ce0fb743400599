"""KV blocks over a real gRPC server: round trip, checksum rejection, limits, timeouts."""
import dataclasses
import multiprocessing as mp
import time

import pytest
import torch

from kvruntime.kv import KVCache
from kvtransport.blocks import BlockError, decode_block, encode_block, verify
from kvtransport.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transport import TransferError, TransferState


def _kv(tokens=50, dtype=torch.float32):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(4, 2, 3, tokens, 64, generator=g).to(dtype), torch.arange(5, 5 + tokens),
                   torch.arange(100, 100 + tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_round_trip_is_exact(dtype):
    kv = _kv(dtype=dtype)
    back = decode_block(encode_block("t1", "m", kv))
    assert torch.equal(back.data, kv.data) and back.data.dtype == dtype
    assert torch.equal(back.positions, kv.positions) and torch.equal(back.token_ids, kv.token_ids)


def test_codec_rejects_corruption_and_wrong_model():
    block = encode_block("t1", "m", _kv())
    flipped = bytearray(block.payload); flipped[123] ^= 0xFF
    with pytest.raises(BlockError, match="checksum"):
        verify(dataclasses.replace(block, payload=bytes(flipped)))
    with pytest.raises(BlockError, match="bytes"):
        verify(dataclasses.replace(block, payload=block.payload[:-4]))
    with pytest.raises(BlockError, match="model"):
        verify(block, model="other")


@pytest.fixture
def server():
    t = GrpcTransport(GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20), model="m")
    addr = t.serve()
    yield t, addr
    t.stop()


def test_push_and_claim_in_process(server):
    rx, addr = server
    tx = GrpcTransport(GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20))
    kv = _kv(300)
    block = encode_block("req-1", "m", kv)
    receipt = tx.send(addr, block, timeout=10)
    assert receipt.bytes_sent == len(block.payload) > 64 << 10            # really chunked
    assert rx.state("req-1") is TransferState.DONE
    assert torch.equal(decode_block(rx.receive("req-1", timeout=1)).data, kv.data)
    with pytest.raises(TransferError, match="not received"):
        rx.receive("req-1", timeout=0.2)                                    # claimed once
    tx.stop()


def test_wrong_checksum_is_rejected_by_the_server(server):
    rx, addr = server
    block = encode_block("req-2", "m", _kv())
    bad = dataclasses.replace(block, header=dataclasses.replace(block.header, checksum=block.header.checksum ^ 1))
    tx = GrpcTransport(GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20))
    with pytest.raises(TransferError, match="checksum") as info:
        tx.send(addr, bad, timeout=10)
    assert info.value.reason == "rejected"
    with pytest.raises(TransferError, match="failed"):
        rx.receive("req-2", timeout=1)
    tx.stop()


def test_full_inbox_is_backpressure_not_a_hang():
    rx = GrpcTransport(GrpcTransportConfig(inbox_bytes=200_000), model="m")
    addr = rx.serve()
    tx = GrpcTransport()
    tx.send(addr, encode_block("a", "m", _kv(20)), timeout=5)               # 123 KB: fits
    with pytest.raises(TransferError) as info:
        tx.send(addr, encode_block("b", "m", _kv(20)), timeout=5)           # would exceed 200 KB
    assert info.value.reason == "backpressure"
    rx.receive("a", timeout=1)
    tx.send(addr, encode_block("b", "m", _kv(20)), timeout=5)               # room again
    rx.stop(); tx.stop()


def test_unreachable_receiver_fails_fast_with_a_reason():
    tx = GrpcTransport()
    t = time.monotonic()
    with pytest.raises(TransferError) as info:
        tx.send("127.0.0.1:1", encode_block("x", "m", _kv(5)), timeout=3)
    assert info.value.reason in ("unavailable", "timeout") and time.monotonic() - t < 10


def _push_from_child(addr, q):
    try:
        GrpcTransport().send(addr, encode_block("child-1", "m", _kv(64)), timeout=20)
        q.put("ok")
    except Exception as exc:  # reported to the parent, which fails the test
        q.put(repr(exc))


def test_push_across_processes(server):
    rx, addr = server
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_push_from_child, args=(addr, q))
    p.start()
    assert q.get(timeout=60) == "ok"
    p.join(10)
    assert torch.equal(decode_block(rx.receive("child-1", timeout=5)).data, _kv(64).data)


def test_config_validation():
    with pytest.raises(ValueError):
        GrpcTransportConfig(chunk_bytes=4 << 20, max_message_bytes=4 << 20)
