"""KV blocks over a real gRPC server: round trip, checksum rejection, limits, timeouts."""
import dataclasses
import multiprocessing as mp
import time

import pytest
import torch

from kvruntime.kv import KVCache
from kvtransport.transfer.blocks import BlockError, decode_block, encode_block, verify
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.interface import TransferError, TransferState


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


# --- the streaming sender (send_kv): CRC computed while framing, sent last -----------------------

from kvtransport.transfer.blocks import block_header, checksum  # noqa: E402
from kvtransport.transfer.grpc_codec import CrcChain, _varint, block_to_messages, stream_messages  # noqa: E402
from kvtransport.transfer.proto import kvtransfer_pb2 as pb  # noqa: E402


@pytest.mark.parametrize("crc_thread", [False, True])
def test_send_kv_round_trip_carries_the_real_checksum(crc_thread):
    cfg = GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20, crc_thread=crc_thread,
                              checksum="always")
    rx, tx = GrpcTransport(cfg, model="m"), GrpcTransport(cfg)
    try:
        addr = rx.serve()
        kv = _kv(300)
        header, payload = block_header("s-1", "m", kv)
        assert header.checksum == 0
        receipt = tx.send_kv(addr, header, payload, timeout=10)
        assert receipt.bytes_sent == payload.nbytes > 64 << 10                 # really chunked
        block = rx.receive("s-1", timeout=1)
        assert block.header.checksum == checksum(kv.data.numpy().tobytes()) != 0
        assert torch.equal(decode_block(block, model="m").data, kv.data)
        assert torch.equal(decode_block(block, check_crc=True).data, kv.data)   # the header's CRC is true
    finally:
        tx.stop()
        rx.stop()


def test_same_host_send_kv_skips_the_checksum_under_auto_and_is_counted():
    cfg = GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20)
    assert cfg.checksum == "auto"
    rx, tx = GrpcTransport(cfg, model="m"), GrpcTransport(cfg)
    try:
        addr = rx.serve()
        assert not tx.checks(addr) and tx.checks("203.0.113.5:50051")      # TEST-NET-3: never this host
        kv = _kv(300)
        header, payload = block_header("u-1", "m", kv)
        assert tx.send_kv(addr, header, payload, timeout=10).bytes_sent == payload.nbytes > 64 << 10
        block = rx.receive("u-1", timeout=1)
        assert block.header.checksum == 0 and rx.stats().unchecked == 1
        assert torch.equal(decode_block(block, model="m").data, kv.data)  # the transport vouches for it
    finally:
        tx.stop()
        rx.stop()


def test_a_receiver_that_refuses_unchecked_blocks_gets_them_checked_and_the_retry_is_reported():
    cfg = GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20)
    rx = GrpcTransport(dataclasses.replace(cfg, checksum="always", require_grant=True), model="m")
    tx = GrpcTransport(cfg)                                                   # auto: same host, so unchecked first
    from kvruntime.messages.transfer import TransferGrant
    try:
        addr = rx.serve()
        kv = _kv(300)
        grant, cred = TransferGrant.issue("u-2", "m", "float32", kv.token_ids.tolist(), first_position=5)
        rx.expect(grant)
        header, payload = block_header("u-2", "m", kv, credential=cred)
        assert not tx.checks(addr)
        receipt = tx.send_kv(addr, header, payload, timeout=10)             # refused before begin, sent again CRC'd
        assert receipt.fallback == "kv_grpc_checksum_required" and receipt.bytes_sent == payload.nbytes
        block = rx.receive("u-2", timeout=1)
        assert block.header.checksum == checksum(kv.data.numpy().tobytes()) != 0
        assert torch.equal(decode_block(block, model="m").data, kv.data)
        s = rx.stats()
        assert s.refused == {"checksum_required": 1} and s.unchecked == 0 and s.rejected == 0 and s.held_bytes == 0
        assert tx.checks(addr)                                               # later blocks to it: CRC'd first time
        grant, cred = TransferGrant.issue("u-3", "m", "float32", kv.token_ids.tolist(), first_position=5)
        rx.expect(grant)
        receipt = tx.send_kv(addr, *block_header("u-3", "m", kv, credential=cred), timeout=10)
        assert receipt.fallback == "" and rx.stats().refused == {"checksum_required": 1}
    finally:
        tx.stop()
        rx.stop()


def test_an_unchecked_stream_is_refused_before_anything_is_reserved():
    rx = GrpcTransport(GrpcTransportConfig(checksum="always"), model="m")
    tx = GrpcTransport()
    try:
        addr = rx.serve()
        header, payload = block_header("u-4", "m", _kv(40))
        with pytest.raises(Exception) as info:
            _raw_push(tx, addr, list(stream_messages(header, payload, 64 << 10, None)))
        assert "[checksum_required]" in info.value.details() and "without a checksum" in info.value.details()
        s = rx.stats()
        assert s.refused == {"checksum_required": 1} and s.held_bytes == 0 and s.pending == 0 and s.blocks == 0
        assert rx.state("u-4") is TransferState.PENDING                      # never begun
    finally:
        tx.stop()
        rx.stop()


def test_unchecked_blocks_are_taken_only_from_this_host():
    from kvtransport.transfer.grpc_server import PushServicer
    from kvtransport.transfer.same_host import address_host, is_local_host, peer_host
    auto = PushServicer(None, None, "m", None, "auto")
    assert auto._takes_unchecked("ipv4:127.0.0.1:40000") and auto._takes_unchecked("ipv6:[::1]:40000")
    assert auto._takes_unchecked("unix:/tmp/s.sock")
    assert not auto._takes_unchecked("ipv4:203.0.113.5:40000")               # another host
    assert not auto._takes_unchecked("something-else")
    assert not PushServicer(None, None, "m", None, "always")._takes_unchecked("ipv4:127.0.0.1:40000")
    assert is_local_host("localhost") and is_local_host("127.0.0.2") and not is_local_host("0.0.0.0")
    assert not is_local_host("no-such-host.invalid") and not is_local_host("")
    assert address_host("[::1]:5") == "[::1]" and peer_host("ipv6:[::1]:5") == "[::1]"
    with pytest.raises(ValueError, match="host:port"):
        address_host("nohostport")
    with pytest.raises(ValueError, match="checksum"):
        GrpcTransportConfig(checksum="never")


def _raw_push(tx, addr, messages):
    return tx._push(addr)(iter(messages), timeout=10)


def _stream(tid, kv, chunk=64 << 10):
    header, payload = block_header(tid, "m", kv)
    return list(stream_messages(header, payload, chunk, CrcChain()))


@pytest.mark.parametrize("case,error", [
    ("wrong_crc", "checksum mismatch"),
    ("no_trailer", "ended without its checksum"),
    ("after_trailer", "message after the checksum"),
    ("flipped_byte", "checksum mismatch"),
    ("trailer_in_plain_stream", "unexpected checksum message"),
])
def test_corrupt_or_malformed_streams_are_rejected_and_nothing_is_claimable(server, case, error):
    rx, addr = server
    tx = GrpcTransport(GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20))
    kv, tid = _kv(300), f"bad-{case}"
    msgs = _stream(tid, kv)
    if case == "wrong_crc":
        crc = int.from_bytes(msgs[-1][1:], "little") ^ 1
        msgs[-1] = msgs[-1][:1] + crc.to_bytes(4, "little")
    elif case == "no_trailer":
        msgs = msgs[:-1]
    elif case == "after_trailer":
        msgs.append(msgs[1])
    elif case == "flipped_byte":
        corrupt = bytearray(msgs[2]); corrupt[100] ^= 0xFF; msgs[2] = bytes(corrupt)
    else:
        msgs = list(block_to_messages(encode_block(tid, "m", kv), 64 << 10)) + [msgs[-1]]
    try:
        reply = _raw_push(tx, addr, msgs)
        assert not reply.ok and error in reply.error
        assert rx.state(tid) is TransferState.FAILED
        with pytest.raises(TransferError, match="failed"):
            rx.receive(tid, timeout=1)
        assert rx.stats().held_bytes == 0 and rx.stats().blocks == 0
    finally:
        tx.stop()


def test_send_kv_is_refused_without_the_grant_and_credential():
    from kvruntime.messages.transfer import TransferGrant
    rx = GrpcTransport(GrpcTransportConfig(require_grant=True), model="m")
    tx = GrpcTransport()
    try:
        addr = rx.serve()
        kv = _kv(40)
        grant, cred = TransferGrant.issue("g-1", "m", "float32", kv.token_ids.tolist(), first_position=5)
        header, payload = block_header("g-1", "m", kv, credential=cred)
        with pytest.raises(TransferError) as info:                               # not announced yet
            tx.send_kv(addr, header, payload, timeout=5)
        assert info.value.reason == "unknown_transfer"
        rx.expect(grant)
        forged, payload = block_header("g-1", "m", kv, credential="forged")
        with pytest.raises(TransferError) as info:
            tx.send_kv(addr, forged, payload, timeout=5)
        assert info.value.reason == "bad_credential"
        tx.send_kv(addr, header, payload, timeout=5)                             # the grant survived the forgery
        assert torch.equal(decode_block(rx.receive("g-1", timeout=1), model="m").data, kv.data)
        with pytest.raises(TransferError) as info:
            tx.send_kv(addr, header, payload, timeout=5)
        assert info.value.reason in ("duplicate", "unknown_transfer")
    finally:
        tx.stop()
        rx.stop()


def test_stream_knobs_are_validated_and_reach_the_channel():
    with pytest.raises(ValueError, match="http2_max_frame_bytes"):
        GrpcTransportConfig(http2_max_frame_bytes=1000)
    with pytest.raises(ValueError, match="http2_max_frame_bytes"):
        GrpcTransportConfig(http2_max_frame_bytes=1 << 24)
    with pytest.raises(ValueError, match="tcp_read_chunk_bytes"):
        GrpcTransportConfig(tcp_read_chunk_bytes=-1)
    with pytest.raises(ValueError, match="http2_lookahead_bytes"):
        GrpcTransportConfig(http2_lookahead_bytes=-1)
    opts = dict(GrpcTransportConfig(http2_max_frame_bytes=1 << 20, tcp_read_chunk_bytes=2 << 20,
                                    http2_lookahead_bytes=8 << 20).channel_options())
    assert opts["grpc.http2.max_frame_size"] == 1 << 20 and opts["grpc.experimental.tcp_read_chunk_size"] == 2 << 20
    assert opts["grpc.http2.lookahead_bytes"] == 8 << 20
    assert "grpc.http2.max_frame_size" not in dict(GrpcTransportConfig().channel_options())
    assert _varint(300) == pb.PushChunk(payload=b"x" * 300).SerializeToString()[1:3]
