"""NIXL transport between two real processes (multiprocessing spawn): a bit-exact round trip,
bad blocks refused with a reason (never a crash of the receiver), duplicates refused without
holding memory. The receiver runs in a child process driven through a command queue."""
import dataclasses
import gc

import pytest
import torch

from kvruntime.kv import KVCache
from kvtransport.transfer.blocks import KVBlock, block_header, encode_block
from kvtransport.transfer.nixl_transport import NixlTransport, NixlTransportConfig
from tests.nixl_pair import nixl_pair
from kvtransport.transfer.interface import TransferError

CFG = NixlTransportConfig(pool_bytes=64 << 20, max_block_bytes=32 << 20, inbox_bytes=48 << 20,
                          read_piece_bytes=1 << 20, stream_piece_bytes=2 << 20)


def _kv(tokens=50, dtype=torch.float32, seed=None):
    g = torch.Generator().manual_seed(tokens if seed is None else seed)
    return KVCache(torch.randn(4, 2, 3, tokens, 64, generator=g).to(dtype), torch.arange(5, 5 + tokens),
                   torch.arange(100, 100 + tokens))


def _receiver(cmds, results):
    """Child: one NixlTransport; answers each command with ("ok", value) or ("error", kind, reason, msg)."""
    from kvtransport.transfer.blocks import decode_block
    t = NixlTransport(CFG, model="m")
    results.put((t.name, t.metadata()))
    while True:
        cmd = cmds.get()
        try:
            if cmd[0] == "stop":
                break
            if cmd[0] == "receive":                       # ("receive", tid, timeout, tokens, dtype name)
                _, tid, timeout, tokens, dtype = cmd
                kv = decode_block(t.receive(tid, timeout=timeout), model="m")
                want = _kv(tokens, getattr(torch, dtype))
                same = (torch.equal(kv.data, want.data) and kv.data.dtype == want.data.dtype
                        and torch.equal(kv.positions, want.positions) and torch.equal(kv.token_ids, want.token_ids))
                del kv
                results.put(("ok", same))
            elif cmd[0] == "metadata":                    # for a second sender agent
                results.put(("ok", t.metadata()))
            elif cmd[0] == "stats":
                gc.collect()
                s = t.stats()
                results.put(("ok", (s.held_bytes, s.blocks, s.pending, dict(s.refused), s.rejected,
                                    t.pool.leased_bytes, dict(t.counters))))
        except Exception as exc:  # reported to the parent, which asserts on it
            results.put(("error", type(exc).__name__, getattr(exc, "reason", ""), str(exc)))
    t.stop()
    results.put(("ok", "stopped"))


@pytest.fixture(scope="module")
def pair():
    yield from nixl_pair(_receiver, CFG)


def _stats(ask):
    status, value = ask("stats")
    assert status == "ok"
    held, blocks, pending, refused, rejected, leased, counters = value
    return dict(held=held, blocks=blocks, pending=pending, refused=refused, rejected=rejected, leased=leased,
                counters=counters)


@pytest.mark.parametrize("tokens,dtype", [(50, "float32"), (3000, "bfloat16"), (4000, "float32")])
def test_round_trip_is_bit_exact(pair, tokens, dtype):
    tx, name, ask = pair
    kv = _kv(tokens, getattr(torch, dtype))                         # 4000 fp32 tokens = 23 MiB: many pieces
    receipt = tx.send(name, encode_block(f"rt-{tokens}", "m", kv), timeout=60)
    assert receipt.bytes_sent == kv.data.nbytes
    assert ask("receive", f"rt-{tokens}", 10, tokens, dtype) == ("ok", True)
    s = _stats(ask)
    assert s["held"] == 0 and s["blocks"] == 0 and s["leased"] == 0        # claimed and dropped: pool free
    assert tx.pool.leased_bytes == 0                                        # sender's staging released


def test_block_encoded_into_the_pool_is_sent_without_staging(pair):
    tx, name, ask = pair
    kv = _kv(3000)
    block = encode_block("in-pool", "m", kv, into=tx.lease)
    assert tx.pool.leased_bytes >= kv.data.nbytes                           # the payload is a pool lease
    tx.send(name, block, timeout=60)
    assert ask("receive", "in-pool", 10, 3000, "float32") == ("ok", True)
    del block
    gc.collect()
    assert tx.pool.leased_bytes == 0


def _rejected(tx, name, ask, block, match):
    with pytest.raises(TransferError, match=match) as info:
        tx.send(name, block, timeout=30)
    status, kind, reason, msg = ask("receive", block.header.transfer_id, 5, 0, "float32")
    assert (status, kind, reason) == ("error", "TransferError", "rejected") and "failed" in msg
    return info.value


def test_corrupt_payload_is_rejected(pair):
    tx, name, ask = pair
    good = encode_block("corrupt", "m", _kv())
    bad = bytearray(good.payload)
    bad[len(bad) // 2] ^= 0xFF
    assert _rejected(tx, name, ask, KVBlock(good.header, bytes(bad)), "checksum").reason == "rejected"


def test_wrong_model_and_wrong_length_are_rejected(pair):
    tx, name, ask = pair
    assert _rejected(tx, name, ask, encode_block("other-model", "other", _kv()), "model").reason == "rejected"
    good = encode_block("short", "m", _kv())
    assert _rejected(tx, name, ask, KVBlock(good.header, bytes(good.payload)[:-4]), "bytes").reason == "rejected"
    h = dataclasses.replace(good.header, transfer_id="bad-dtype", dtype="int8")
    assert _rejected(tx, name, ask, KVBlock(h, good.payload), "dtype").reason == "rejected"
    s = _stats(ask)
    assert s["held"] == 0 and s["leased"] == 0 and s["pending"] == 0


def test_unknown_transfer_id_and_unknown_peer(pair):
    tx, name, ask = pair
    status, kind, reason, msg = ask("receive", "never-sent", 0.3, 0, "float32")
    assert (status, kind, reason) == ("error", "TransferError", "timeout") and "never-sent" in msg
    with pytest.raises(TransferError) as info:
        tx.send("nobody", encode_block("x", "m", _kv(5)), timeout=5)
    assert info.value.reason == "unknown_peer"
    with pytest.raises(ValueError, match="agent"):
        tx.add_peer("someone-else", tx.metadata())


def test_duplicate_transfer_id_is_refused_and_holds_no_memory(pair):
    tx, name, ask = pair
    kv = _kv(200)
    tx.send(name, encode_block("dup", "m", kv), timeout=30)
    before = _stats(ask)
    with pytest.raises(TransferError) as info:
        tx.send(name, encode_block("dup", "m", kv), timeout=30)
    assert info.value.reason == "duplicate"
    after = _stats(ask)
    assert after["held"] == before["held"] == kv.data.nbytes                 # counted once
    assert after["leased"] == before["leased"] and after["refused"].get("duplicate", 0) >= 1
    assert ask("receive", "dup", 5, 200, "float32") == ("ok", True)
    with pytest.raises(TransferError) as info:                              # a claimed id stays refused
        tx.send(name, encode_block("dup", "m", kv), timeout=30)
    assert info.value.reason == "duplicate"
    s = _stats(ask)
    assert s["held"] == 0 and s["leased"] == 0 and s["blocks"] == 0
    assert tx.pool.leased_bytes == 0


@pytest.mark.parametrize("tokens,dtype", [(50, "float32"), (4000, "float32"), (3000, "bfloat16")])
def test_pipelined_send_is_bit_exact_and_frees_both_pools(pair, tokens, dtype):
    """send_kv: offer first, payload copied into the lease piece by piece and announced (2 MiB
    here: 12 announcements for 4000 fp32 tokens) while the receiver READs; the CRC comes last."""
    tx, name, ask = pair
    header, payload = block_header(f"st-{tokens}-{dtype}", "m", _kv(tokens), dtype=dtype)
    receipt = tx.send_kv(name, header, payload, timeout=60)
    assert receipt.bytes_sent == header.payload_bytes
    assert ask("receive", f"st-{tokens}-{dtype}", 10, tokens, dtype) == ("ok", True)
    s = _stats(ask)
    assert s["held"] == 0 and s["blocks"] == 0 and s["leased"] == 0 and s["pending"] == 0
    gc.collect()
    assert tx.pool.leased_bytes == 0


def test_pipelined_send_with_a_bad_checksum_or_a_bad_header_is_rejected(pair, monkeypatch):
    tx, name, ask = pair
    import kvtransport.transfer.nixl_read as nr                  # the CRC thread's checksum, in this (sender) process
    header, payload = block_header("st-crc", "m", _kv(4000))
    real = nr.checksum_extend
    monkeypatch.setattr(nr, "checksum_extend", lambda crc, piece: real(crc, piece) ^ 1)   # the sender's CRC lies
    with pytest.raises(TransferError, match="checksum") as info:
        tx.send_kv(name, header, payload, timeout=30)
    monkeypatch.undo()
    assert info.value.reason == "rejected"
    status, kind, reason, msg = ask("receive", "st-crc", 5, 0, "float32")
    assert (status, kind, reason) == ("error", "TransferError", "rejected")
    header, payload = block_header("st-model", "other", _kv(4000))                     # refused at the offer
    with pytest.raises(TransferError, match="model") as info:
        tx.send_kv(name, header, payload, timeout=30)
    assert info.value.reason == "rejected"
    s = _stats(ask)
    assert s["held"] == 0 and s["leased"] == 0 and s["pending"] == 0
    gc.collect()
    assert tx.pool.leased_bytes == 0
    header, payload = block_header("st-after", "m", _kv(60))                           # still works
    tx.send_kv(name, header, payload, timeout=30)
    assert ask("receive", "st-after", 5, 60, "float32") == ("ok", True)


def test_forged_notifications_are_counted_not_fatal(pair):
    tx, name, ask = pair
    with tx._lock:                                                          # a peer sending garbage
        tx._agent.send_notif(name, b"O\x01\x02")
        tx._agent.send_notif(name, b"Zzz")
    tx.send(name, encode_block("after-garbage", "m", _kv(60)), timeout=30)  # the receiver still works
    assert ask("receive", "after-garbage", 5, 60, "float32") == ("ok", True)
    counters = _stats(ask)["counters"]
    assert counters.get("bad_offer") == 1 and counters.get("bad_notification") == 1


def test_a_cancel_is_taken_only_from_the_peer_that_pushes_the_transfer(pair):
    """Two real sender agents: a second agent's CANCEL of a transfer the first pushed is refused and
    counted (``foreign_cancel``), the block stays and is received bit exact; the pushing agent's own
    CANCEL drops its transfer (the receiver's claim then fails as rejected)."""
    from kvtransport.transfer.nixl_wire import CANCEL
    from tests.conftest import wait_for
    tx, name, ask = pair
    status, md = ask("metadata")
    assert status == "ok"
    intruder = NixlTransport(CFG)
    try:
        intruder.add_peer(name, md)
        tx.send(name, encode_block("held", "m", _kv(60)), timeout=30)            # delivered, not yet claimed
        before = _stats(ask)
        with intruder._lock:
            intruder._agent.send_notif(name, CANCEL + b"held")
        wait_for(lambda: _stats(ask)["refused"].get("foreign_cancel", 0) == before["refused"].get("foreign_cancel", 0) + 1,
                 10, "the foreign cancel to be counted", every=0.1)
        assert _stats(ask)["blocks"] == before["blocks"]                          # nothing was dropped
        assert ask("receive", "held", 5, 60, "float32") == ("ok", True)
        tx.send(name, encode_block("cancel-me", "m", _kv(60)), timeout=30)
        held = _stats(ask)["blocks"]
        with tx._lock:
            tx._agent.send_notif(name, CANCEL + b"cancel-me")                      # its own pusher's cancel
        wait_for(lambda: _stats(ask)["blocks"] == held - 1, 10, "the owner's cancel to drop the block", every=0.1)
        status, kind, reason, msg = ask("receive", "cancel-me", 5, 0, "float32")
        assert (status, kind, reason) == ("error", "TransferError", "rejected") and "cancelled by sender" in msg
        s = _stats(ask)
        assert s["held"] == 0 and s["blocks"] == 0
    finally:
        intruder.stop()


def test_config_validation():
    with pytest.raises(ValueError):
        NixlTransportConfig(pool_bytes=0)
    with pytest.raises(ValueError):
        NixlTransportConfig(busy_poll_s=0.1, idle_poll_s=0.01)
    with pytest.raises(ValueError, match="expect_poll_s"):
        NixlTransportConfig(expect_poll_s=0.5)                  # slower than idle polling
    with pytest.raises(ValueError, match="ucx_error_handling"):
        NixlTransportConfig(ucx_error_handling="retry")


def test_no_ucx_error_handling_still_moves_and_checks_blocks():
    """ucx_error_handling="none" (notifications over shared memory): a pipelined round trip is
    bit exact and a lying checksum is still rejected."""
    import dataclasses
    import kvtransport.transfer.nixl_read as nr
    from kvtransport.transfer.blocks import decode_block
    cfg = dataclasses.replace(CFG, ucx_error_handling="none")
    rx, tx = NixlTransport(cfg, model="m"), NixlTransport(cfg, model="m")
    try:
        tx.add_peer(rx.name, rx.metadata())
        kv = _kv(3000)
        header, payload = block_header("none-ok", "m", kv)
        tx.send_kv(rx.name, header, payload, timeout=30)
        assert torch.equal(decode_block(rx.receive("none-ok", timeout=5), model="m").data, kv.data)
        header, payload = block_header("none-bad", "m", kv)
        import itertools
        real = nr.checksum_extend
        calls = itertools.count()                       # next() is atomic: the two CRC threads race here

        def lying(crc, piece):                          # the first piece CRC'd (either side's) lies: the two must differ
            return real(crc, piece) ^ (1 if next(calls) == 0 else 0)
        nr.checksum_extend = lying
        try:
            with pytest.raises(TransferError, match="checksum"):
                tx.send_kv(rx.name, header, payload, timeout=30)
        finally:
            nr.checksum_extend = real
    finally:
        tx.stop()
        rx.stop()


def _in_pool(tx, kv):
    """``kv``'s data copied into a lease of ``tx``'s registered pool (as the prefill builds it)."""
    buf = tx.lease(kv.data.nbytes)
    data = torch.from_numpy(buf).view(kv.data.dtype).view(kv.data.shape)
    data.copy_(kv.data)
    return KVCache(data, kv.positions, kv.token_ids)


def test_kv_built_in_the_pool_is_sent_without_a_copy_and_its_crc_is_checked(pair, monkeypatch):
    """send_kv of a tensor that lives in the pool: no staging lease, no copy (staged_bytes stays
    put), pieces CRC'd and announced; bit exact at the receiver. A lying sender CRC is refused."""
    import kvtransport.transfer.nixl_send as ns
    from kvtransport.transfer.blocks import wire_header
    tx, name, ask = pair
    kv = _in_pool(tx, _kv(4000))                                    # 23 MiB: 12 pieces of 2 MiB
    staged, zero, leased = tx.counters["staged_bytes"], tx.counters["zero_copy_sends"], tx.pool.leased_bytes
    receipt = tx.send_kv(name, wire_header("zc-ok", "m", kv), kv.data, timeout=60)
    assert receipt.bytes_sent == kv.data.nbytes
    assert tx.counters["staged_bytes"] == staged and tx.counters["zero_copy_sends"] == zero + 1
    assert tx.pool.leased_bytes == leased                           # no staging lease was taken
    assert ask("receive", "zc-ok", 10, 4000, "float32") == ("ok", True)
    real = ns.checksum_extend
    monkeypatch.setattr(ns, "checksum_extend", lambda crc, piece: real(crc, piece) ^ 1)   # the sender's CRC lies
    with pytest.raises(TransferError, match="checksum") as info:
        tx.send_kv(name, wire_header("zc-bad", "m", kv), kv.data, timeout=30)
    monkeypatch.undo()
    assert info.value.reason == "rejected" and tx.counters["staged_bytes"] == staged
    status, kind, reason, msg = ask("receive", "zc-bad", 5, 0, "float32")
    assert (status, kind, reason) == ("error", "TransferError", "rejected")
    del kv, info                                                    # the traceback's frames hold the KV too
    gc.collect()
    assert tx.pool.leased_bytes == 0                                # the KV's lease ends with the KV
    s = _stats(ask)
    assert s["held"] == 0 and s["leased"] == 0 and s["pending"] == 0


def test_a_tensor_in_another_dtype_or_layout_is_cast_straight_into_the_lease(pair):
    """fp32 KV sent as bf16 (a bf16 engine), or a non-contiguous slice: copied once into the
    staging lease (cast/gathered in the same pass), bit exact at the receiver."""
    from kvtransport.transfer.blocks import wire_header
    tx, name, ask = pair
    kv = _kv(3000)                                                  # fp32; the receiver expects _kv(3000, bf16)
    staged = tx.counters["staged_bytes"]
    header = wire_header("cast-bf16", "m", kv, dtype="bfloat16")
    tx.send_kv(name, header, kv.data, timeout=60)
    assert tx.counters["staged_bytes"] == staged + header.payload_bytes == staged + kv.data.nbytes // 2
    assert ask("receive", "cast-bf16", 10, 3000, "bfloat16") == ("ok", True)
    wide = _kv(3000, seed=3000)
    pad = torch.arange(7)
    wide = KVCache(torch.cat([torch.zeros_like(wide.data[:, :, :, :7]), wide.data], dim=3),
                   torch.cat([pad, wide.positions]), torch.cat([pad, wide.token_ids]))
    part = wide.slice(7)                                            # a view: not contiguous
    assert not part.data.is_contiguous()
    tx.send_kv(name, wire_header("slice", "m", part), part.data, timeout=60)
    assert ask("receive", "slice", 10, 3000, "float32") == ("ok", True)
    with pytest.raises(ValueError, match="header"):
        tx.send_kv(name, wire_header("shape", "m", _kv(10)), kv.data, timeout=5)
    gc.collect()
    assert tx.pool.leased_bytes == 0
