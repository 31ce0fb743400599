"""gRPC at block sizes the cluster really moves: a 180 MiB round trip across processes, bit-exact;
a transfer id accepted once; inbox and pool accounting exact after refusals, claims and expiry."""
import dataclasses
import gc
import multiprocessing as mp
import time

import pytest
import torch

from kvruntime.kv import KVCache
from kvtransport.transfer.blocks import KVBlock, block_header, decode_block, encode_block
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.interface import TransferError

BIG_TOKENS = 4096                      # SmolLM2 shape, fp32: 30 * 2 * 3 * 4096 * 64 * 4 B = 180 MiB


def _big_kv():
    g = torch.Generator().manual_seed(7)
    return KVCache(torch.randn(30, 2, 3, BIG_TOKENS, 64, generator=g), torch.arange(BIG_TOKENS),
                   torch.arange(1000, 1000 + BIG_TOKENS))


def _kv(tokens=50):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(4, 2, 3, tokens, 64, generator=g), torch.arange(tokens), torch.arange(tokens))


def _push_big(addr, q, streamed=False, checksum="auto"):
    try:
        if streamed:                   # the streaming sender: CRC while framing, sent last (or none: same host)
            receipt = GrpcTransport(GrpcTransportConfig(checksum=checksum)).send_kv(
                addr, *block_header("big", "m", _big_kv()), timeout=120)
        else:
            receipt = GrpcTransport().send(addr, encode_block("big", "m", _big_kv()), timeout=120)
        q.put(("ok", receipt.bytes_sent))
    except Exception as exc:  # reported to the parent, which fails the test
        q.put(("error", repr(exc)))


@pytest.mark.parametrize("streamed,checksum", [(False, "always"), (True, "always"), (True, "auto")],
                         ids=["send", "send_kv", "send_kv_same_host_unchecked"])
def test_180_mib_round_trip_across_processes_is_bit_exact(streamed, checksum):
    rx = GrpcTransport(GrpcTransportConfig(checksum=checksum), model="m")
    addr = rx.serve()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_push_big, args=(addr, q, streamed, checksum), daemon=True)
    p.start()
    try:
        status, sent = q.get(timeout=300)
        assert status == "ok", sent
        want = _big_kv()
        assert sent == want.data.nbytes == 180 * 2**20
        block = rx.receive("big", timeout=10)
        unchecked = streamed and checksum == "auto"                 # another process of this host
        assert rx.stats().unchecked == unchecked
        assert block.header.checksum == (0 if unchecked else encode_block("big", "m", want).header.checksum)
        kv = decode_block(block, model="m")
        del block
        assert torch.equal(kv.data, want.data)
        assert torch.equal(kv.positions, want.positions) and torch.equal(kv.token_ids, want.token_ids)
        del kv
        gc.collect()
        assert rx.stats().held_bytes == 0 and rx._servicer.pool.leased_bytes == 0 and rx.pool_misses == 0
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
        rx.stop()


@pytest.fixture
def rx():
    t = GrpcTransport(GrpcTransportConfig(inbox_bytes=400_000, max_block_bytes=300_000, pool_bytes=8 << 20,
                                          unclaimed_ttl_s=60), model="m")
    addr = t.serve()
    tx = GrpcTransport()
    yield t, tx, addr
    tx.stop()
    t.stop()


def test_duplicate_transfer_id_is_refused_and_counted_once(rx):
    rx, tx, addr = rx
    block = encode_block("a", "m", _kv(20))                                 # 122,880 bytes
    tx.send(addr, block, timeout=10)
    with pytest.raises(TransferError) as info:
        tx.send(addr, block, timeout=10)
    assert info.value.reason == "duplicate"
    s = rx.stats()
    assert s.held_bytes == len(block.payload) and s.blocks == 1 and s.refused == {"duplicate": 1}
    assert torch.equal(decode_block(rx.receive("a", timeout=1)).data, _kv(20).data)
    assert rx.stats().held_bytes == 0
    with pytest.raises(TransferError) as info:                              # a claimed id stays refused
        tx.send(addr, block, timeout=10)
    assert info.value.reason == "duplicate"


def test_inbox_accounting_is_exact_after_refusals(rx):
    rx, tx, addr = rx
    a, b = encode_block("a", "m", _kv(20)), encode_block("b", "m", _kv(20))
    tx.send(addr, a, timeout=10)
    tx.send(addr, b, timeout=10)                                            # 245,760 of 400,000 held
    refusals = [(encode_block("big", "m", _kv(60)), "too_large"),           # 368,640 > 300,000
                (encode_block("full", "m", _kv(30)), "backpressure"),       # 184,320 would exceed 400,000
                (a, "duplicate")]
    for block, reason in refusals:
        with pytest.raises(TransferError) as info:
            tx.send(addr, block, timeout=10)
        assert info.value.reason == reason
    bad = dataclasses.replace(encode_block("crc", "m", _kv(5)).header, checksum=1)
    with pytest.raises(TransferError, match="checksum"):
        tx.send(addr, KVBlock(bad, encode_block("crc", "m", _kv(5)).payload), timeout=10)
    with pytest.raises(TransferError, match="model"):
        tx.send(addr, encode_block("other", "other-model", _kv(5)), timeout=10)
    s = rx.stats()
    assert s.held_bytes == 2 * len(a.payload) and s.blocks == 2 and s.pending == 0
    assert s.refused == {"too_large": 1, "backpressure": 1, "duplicate": 1} and s.rejected == 2
    for tid in ("a", "b"):
        rx.receive(tid, timeout=1)
    for tid in ("crc", "other"):
        with pytest.raises(TransferError, match="failed"):
            rx.receive(tid, timeout=1)
    gc.collect()
    s = rx.stats()
    assert s.held_bytes == 0 and s.blocks == 0 and rx._servicer.pool.leased_bytes == 0
    tx.send(addr, encode_block("full", "m", _kv(30)), timeout=10)          # room again


def test_unclaimed_block_expires_and_is_counted():
    rx = GrpcTransport(GrpcTransportConfig(unclaimed_ttl_s=0.2, pool_bytes=1 << 20), model="m")
    addr = rx.serve()
    tx = GrpcTransport()
    try:
        tx.send(addr, encode_block("late", "m", _kv(10)), timeout=10)
        time.sleep(0.4)
        s = rx.stats()
        assert s.expired == 1 and s.held_bytes == 0 and s.blocks == 0
        with pytest.raises(TransferError, match="expired"):
            rx.receive("late", timeout=1)
        gc.collect()
        assert rx._servicer.pool.leased_bytes == 0
    finally:
        tx.stop()
        rx.stop()


def test_malloc_tuning_is_a_setting_applied_once_per_process(monkeypatch):
    import kvtransport.transfer.grpc_config as gt
    with pytest.raises(ValueError, match="malloc_keep_bytes"):
        GrpcTransportConfig(malloc_keep_bytes=-1)
    monkeypatch.setattr(gt, "_malloc_tuned", False)
    assert gt.tune_malloc(0) is False and gt._malloc_tuned is False      # 0: glibc defaults stay
    assert gt.tune_malloc(256 << 20) is True                             # glibc (this image): applied
    assert gt.tune_malloc(256 << 20) is False                            # once per process


@pytest.mark.parametrize("huge", [True, False])
def test_buffer_pool_leases_and_releases_with_or_without_huge_pages(huge):
    from kvtransport.transfer.buffer_pool import BufferPool
    pool = BufferPool(8 << 20, huge_pages=huge)
    a, b = pool.lease(5 << 20), pool.lease(3 << 20)
    assert a is not None and b is not None and pool.lease(4096) is None
    a[:] = 7
    b[:] = 9
    assert int(a.sum()) == 7 * (5 << 20) and int(pool.arena[:5 << 20].sum()) == 7 * (5 << 20)
    del a
    gc.collect()
    assert pool.leased_bytes == 3 << 20 and pool.lease(5 << 20) is not None
