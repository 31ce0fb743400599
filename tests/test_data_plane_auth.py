"""The authenticated data plane: a decode worker's Receiver accepts a
KV block only for a transfer the router announced (a TransferGrant), carrying that transfer's
credential and the granted shape. Over the real gRPC server and real NIXL (a receiver in a child
process): forged, unknown, wrong-model/dtype/length and corrupt blocks are refused with their
reason and hold no memory; duplicate ids cannot exhaust the inbox; unused grants expire, counted.
Through the real router: a bad block is a counted fallback and the request completes."""
import asyncio
import dataclasses
import gc
import multiprocessing as mp
import time

import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import KVBlock, decode_block, encode_block
from kvtransport.transfer.endpoints import Receiver
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.interface import TransferError

GCFG = GrpcTransportConfig(require_grant=True, inbox_bytes=400_000, max_block_bytes=300_000, pool_bytes=8 << 20)


def _kv(tokens=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(2, 2, 2, tokens, 32, generator=g).to(dtype), torch.arange(tokens),
                   torch.arange(100, 100 + tokens))                    # 40 fp32 tokens: 40 KiB


def _grant(tid, kv, dtype="float32"):
    return TransferGrant.issue(tid, "m", dtype, kv.token_ids.tolist(), 0)


def _push(send, block):
    """None if delivered, else the refusal reason."""
    try:
        send(block)
        return None
    except TransferError as exc:
        return exc.reason


@pytest.fixture
def grpc_rx():
    rx = Receiver("grpc", "m", "float32", bind="127.0.0.1", advertise="127.0.0.1", grpc_cfg=GCFG)
    tx = GrpcTransport()
    try:
        yield rx, (lambda block: tx.send(rx.endpoint.grpc_address, block, timeout=10))
    finally:
        tx.stop()
        rx.stop()


def test_grpc_forged_unknown_and_misshaped_blocks_are_refused_holding_nothing(grpc_rx):
    rx, send = grpc_rx
    kv = _kv()
    grant, cred = _grant("t1", kv)
    rx.expect(grant)
    assert _push(send, encode_block("t1", "m", kv)) == "bad_credential"                       # valid CRC, no credential
    assert _push(send, encode_block("t1", "m", kv, credential="0" * 32)) == "bad_credential"
    assert _push(send, encode_block("nobody", "m", kv, credential=cred)) == "unknown_transfer"
    assert _push(send, encode_block("t1", "other", kv, credential=cred)) == "wrong_model"
    assert _push(send, encode_block("t1", "m", kv, dtype="bfloat16", credential=cred)) == "wrong_dtype"
    assert _push(send, encode_block("t1", "m", _kv(39), credential=cred)) == "wrong_length"
    s = rx.stats()
    assert s.held_bytes == 0 and s.pending == 0 and s.blocks == 0 and s.grants == 1
    assert s.refused == {"bad_credential": 2, "unknown_transfer": 1, "wrong_model": 1, "wrong_dtype": 1,
                         "wrong_length": 1}
    assert rx.grpc._servicer.pool.leased_bytes == 0                     # no receive buffer was taken
    assert _push(send, encode_block("t1", "m", kv, credential=cred)) is None   # the grant survived the forgeries
    got = decode_block(rx.receive("t1", timeout=5), model="m")
    assert torch.equal(got.data, kv.data) and rx.stats().grants == 0
    assert _push(send, encode_block("t1", "m", kv, credential=cred)) == "duplicate"   # a grant is used once


def test_grpc_corrupt_payload_is_rejected_and_released(grpc_rx):
    rx, send = grpc_rx
    kv = _kv()
    grant, cred = _grant("c1", kv)
    rx.expect(grant)
    good = encode_block("c1", "m", kv, credential=cred)
    bad = bytearray(good.payload)
    bad[len(bad) // 3] ^= 0x01
    assert _push(send, KVBlock(good.header, bytes(bad))) == "rejected"
    with pytest.raises(TransferError, match="checksum"):
        rx.receive("c1", timeout=5)
    gc.collect()
    s = rx.stats()
    assert s.held_bytes == 0 and s.rejected == 1 and rx.grpc._servicer.pool.leased_bytes == 0


def test_duplicate_ids_cannot_exhaust_the_inbox(grpc_rx):
    rx, send = grpc_rx
    kv = _kv()                                                   # 40 KiB; the inbox holds 400 KB
    grant, cred = _grant("d1", kv)
    rx.expect(grant)
    block = encode_block("d1", "m", kv, credential=cred)
    assert _push(send, block) is None
    assert [_push(send, block) for _ in range(20)] == ["duplicate"] * 20
    assert [_push(send, encode_block(f"x{i}", "m", kv, credential=cred)) for i in range(20)] == \
        ["unknown_transfer"] * 20
    assert rx.stats().held_bytes == kv.data.nbytes                # one block's bytes, counted once
    rx.receive("d1", timeout=5)
    gc.collect()
    assert rx.stats().held_bytes == 0
    for i in range(8):                                           # 8 x 40 KiB more than the 20 refused would
        g, c = _grant(f"ok{i}", kv)
        rx.expect(g)
        assert _push(send, encode_block(f"ok{i}", "m", kv, credential=c)) is None
        rx.receive(f"ok{i}", timeout=5)


def test_unused_grants_and_unclaimed_blocks_expire_counted():
    rx = Receiver("grpc", "m", "float32", bind="127.0.0.1", grpc_cfg=dataclasses.replace(GCFG, unclaimed_ttl_s=0.5))
    tx = GrpcTransport()
    try:
        kv = _kv()
        g1, _ = _grant("never-sent", kv)
        g2, c2 = _grant("never-claimed", kv)
        rx.expect(g1)
        rx.expect(g2)
        tx.send(rx.endpoint.grpc_address, encode_block("never-claimed", "m", kv, credential=c2), timeout=10)
        assert rx.stats().held_bytes == kv.data.nbytes and rx.stats().grants == 1
        time.sleep(0.8)
        s = rx.stats()
        assert s.grants == 0 and s.grants_expired == 1 and s.expired == 1 and s.held_bytes == 0
        with pytest.raises(ValueError, match="already"):
            rx.expect(g2)                                        # an id is granted once
    finally:
        tx.stop()
        rx.stop()


# ---- real NIXL: the receiver in a child process ---------------------------------------------
def _nixl_receiver(cmds, results):
    from kvtransport.transfer.endpoints import Receiver as Rx
    from kvtransport.transfer.nixl_transport import NixlTransportConfig
    rx = Rx("nixl", "m", "float32", bind="127.0.0.1", grpc_cfg=GCFG,
            nixl_cfg=NixlTransportConfig(pool_bytes=16 << 20, max_block_bytes=300_000, inbox_bytes=400_000,
                                         require_grant=True))
    results.put(rx.endpoint)
    while (cmd := cmds.get())[0] != "stop":
        try:
            if cmd[0] == "expect":
                rx.expect(cmd[1])
                results.put(("ok", None))
            elif cmd[0] == "receive":
                kv = decode_block(rx.receive(cmd[1], timeout=5), model="m")
                results.put(("ok", (kv.data.clone(), kv.positions.clone())))
                del kv                                           # the block's pool lease ends here
            elif cmd[0] == "stats":
                gc.collect()
                s = rx.stats()
                results.put(("ok", (s.held_bytes, s.pending, s.blocks, s.refused, rx.nixl.pool.leased_bytes)))
        except Exception as exc:  # reported to the parent, which asserts on it
            results.put(("error", getattr(exc, "reason", ""), str(exc)))
    rx.stop()
    results.put(("ok", "stopped"))


@pytest.fixture(scope="module")
def nixl_pair():
    from kvtransport.transfer.nixl_transport import NixlTransport, NixlTransportConfig
    ctx = mp.get_context("spawn")
    cmds, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_nixl_receiver, args=(cmds, results), daemon=True)
    proc.start()
    tx = None
    try:
        ep = results.get(timeout=120)
        assert ep.transport == "nixl" and ep.nixl_metadata
        tx = NixlTransport(NixlTransportConfig(pool_bytes=16 << 20))
        tx.add_peer(ep.nixl_agent, ep.nixl_metadata)

        def ask(*cmd):
            cmds.put(cmd)
            return results.get(timeout=60)

        yield (lambda block: tx.send(ep.nixl_agent, block, timeout=20)), ask
        cmds.put(("stop",))
        assert results.get(timeout=30) == ("ok", "stopped")
    finally:
        if tx is not None:
            tx.stop()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_nixl_refuses_forged_unknown_misshaped_corrupt_and_duplicate_blocks(nixl_pair):
    send, ask = nixl_pair
    kv = _kv()
    grant, cred = _grant("n1", kv)
    assert ask("expect", grant) == ("ok", None)
    assert _push(send, encode_block("n1", "m", kv)) == "bad_credential"
    assert _push(send, encode_block("n-unknown", "m", kv, credential=cred)) == "unknown_transfer"
    assert _push(send, encode_block("n1", "m", kv, dtype="bfloat16", credential=cred)) == "wrong_dtype"
    assert _push(send, encode_block("n1", "other", kv, credential=cred)) == "wrong_model"
    assert _push(send, encode_block("n1", "m", _kv(41), credential=cred)) == "wrong_length"
    status, (held, pending, blocks, refused, leased) = ask("stats")
    assert (held, pending, blocks, leased) == (0, 0, 0, 0)
    assert refused == {"bad_credential": 1, "unknown_transfer": 1, "wrong_dtype": 1, "wrong_model": 1,
                       "wrong_length": 1}
    assert _push(send, encode_block("n1", "m", kv, credential=cred)) is None
    assert _push(send, encode_block("n1", "m", kv, credential=cred)) == "duplicate"
    status, (data, positions) = ask("receive", "n1")
    assert status == "ok" and torch.equal(data, kv.data) and torch.equal(positions, kv.positions)
    g2, c2 = _grant("n2", kv)
    assert ask("expect", g2) == ("ok", None)
    good = encode_block("n2", "m", kv, credential=c2)
    bad_header = dataclasses.replace(good.header, checksum=good.header.checksum ^ 1)
    assert _push(send, KVBlock(bad_header, good.payload)) == "rejected"
    status, reason, msg = ask("receive", "n2")
    assert status == "error" and reason == "rejected" and "checksum" in msg
    status, (held, pending, blocks, refused, leased) = ask("stats")
    assert (held, pending, blocks, leased) == (0, 0, 0, 0)


# ---- through the real router: a bad block is a counted fallback, the request completes ------
class _Tampering(GrpcTransport):
    """The real gRPC sender, changing one thing about every block it sends."""

    def __init__(self, change):
        super().__init__()
        self.change = change

    def send(self, address, block, *, timeout):
        return super().send(address, self.change(block), timeout=timeout)


def _with(**kw):
    return lambda b: KVBlock(dataclasses.replace(b.header, **kw), b.payload)


@pytest.mark.slow
@pytest.mark.parametrize("change,reason", [
    (_with(credential=""), "kv_transfer_bad_credential"),
    (_with(transfer_id="guessed-id"), "kv_transfer_unknown_transfer"),
    (_with(model="other-model"), "kv_transfer_wrong_model"),
    (_with(dtype="bfloat16"), "kv_transfer_wrong_dtype"),
    (lambda b: KVBlock(dataclasses.replace(b.header, checksum=b.header.checksum ^ 7), b.payload), "kv_transfer_rejected"),
])
def test_router_counts_a_bad_block_as_a_fallback_and_completes(smol, tmp_path, change, reason):
    from tests.test_router_fallback import _complete, _router
    from kvtransport.transfer.endpoints import BlockKVSender
    good, gb = _router(smol, BlockKVSender(GrpcTransport()), tmp_path)
    bad, bb = _router(smol, BlockKVSender(_Tampering(change)), tmp_path)
    try:
        segs = [{"text": "The lighthouse on Hallo Point was built in 1871. When was it built?"}]
        want, fin_ok = asyncio.run(_complete(good, segs, "exact"))
        got, fin = asyncio.run(_complete(bad, segs, "exact"))
        assert fin_ok.fallbacks == () and fin_ok.transport == "grpc" and dict(fin_ok.stages)["transfer"] > 0
        from cluster.http.api import _kvnotes
        explained = _kvnotes(fin_ok, True)["explain"]                 # what "explain": true returns
        assert explained["transport"] == "grpc" and {"serialise", "transfer", "receive", "load",
                                                     "first_token"} <= set(explained["stages"])
        assert got == want and len(got) > 0 and fin.fallbacks == (reason,) and fin.cached_tokens == 0
        assert f'kvnotes_fallbacks_total{{reason="{reason}"}} 1.0' in bad.metrics.render().decode()
        s = bb.rx.stats()
        assert s.held_bytes == 0 and s.blocks == 0                # nothing pinned by the refused block
    finally:
        gb.rx.stop()
        bb.rx.stop()
