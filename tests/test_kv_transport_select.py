"""``kv_transport: auto | nixl | grpc``: what each end runs when NIXL is missing or a peer is
unusable, and that every fall back to gRPC is reported (the router counts it) while the block
still arrives over the real gRPC server."""
import sys

import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.config import ClusterConfig
from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import decode_block
from kvtransport.transfer.endpoints import Receiver, Sender


def _kv(tokens=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return KVCache(torch.randn(2, 2, 2, tokens, 16, generator=g).to(dtype), torch.arange(tokens),
                   torch.arange(50, 50 + tokens))


def _ship(rx, tx, kv, tid, dtype="float32"):
    grant, cred = TransferGrant.issue(tid, "m", dtype, kv.token_ids.tolist())
    rx.expect(grant)
    res = tx.send(rx.endpoint, tid, "m", kv, credential=cred, timeout=10)
    got = decode_block(rx.receive(tid, timeout=5), model="m")
    return got, res.transport, res.stages, list(res.fallbacks), res.receipt


def test_config_refuses_an_unknown_transport():
    assert ClusterConfig.of(kv_transport="grpc").transport.kind == "grpc"
    with pytest.raises(ValueError, match="kv_transport"):
        ClusterConfig.from_dict({"kv_transport": "rdma"})


def test_auto_without_nixl_falls_back_to_grpc_counted(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)            # NIXL does not import here
    rx = Receiver("auto", "m", "float32", bind="127.0.0.1")
    tx = Sender("auto")
    try:
        assert rx.endpoint.transport == "grpc" and rx.fallback == "kv_transport_nixl_unavailable"
        assert tx.nixl is None and tx.fallback == "kv_transport_nixl_unavailable"
        kv = _kv()
        got, used, stages, fallbacks, _ = _ship(rx, tx, kv, "a1")
        assert torch.equal(got.data, kv.data) and used == "grpc"
        assert fallbacks == ["kv_transport_nixl_unavailable"] and stages["transfer"] > 0 and "serialise" in stages
        with pytest.raises(RuntimeError, match="kv_transport is 'nixl'"):
            Sender("nixl")
    finally:
        tx.stop()
        rx.stop()


def test_grpc_is_chosen_without_fallback_and_blocks_travel_in_the_engine_dtype():
    rx = Receiver("grpc", "m", "bfloat16", bind="127.0.0.1")
    tx = Sender("grpc")
    try:
        kv = _kv()                                                    # fp32 KV, bf16 decode engine
        got, used, _, fallbacks, receipt = _ship(rx, tx, kv, "g1", dtype="bfloat16")
        assert used == "grpc" and fallbacks == [] and got.data.dtype == torch.bfloat16
        assert receipt.bytes_sent == kv.data.nbytes // 2              # half the bytes of fp32 on the wire
        assert torch.equal(got.data, kv.data.to(torch.bfloat16))
    finally:
        tx.stop()
        rx.stop()


def test_a_decode_worker_that_checks_every_block_gets_a_crc_and_the_sender_reports_it():
    from kvtransport.transfer.grpc_transport import GrpcTransportConfig
    rx = Receiver("grpc", "m", "float32", bind="127.0.0.1",
                  grpc_cfg=GrpcTransportConfig(require_grant=True, checksum="always"))
    tx = Sender("grpc")                                               # checksum auto: same host, unchecked first
    try:
        kv = _kv()
        got, used, _, fallbacks, _ = _ship(rx, tx, kv, "c1")
        assert torch.equal(got.data, kv.data) and used == "grpc"
        assert fallbacks == ["kv_grpc_checksum_required"]             # the router counts it
        assert rx.stats().refused == {"checksum_required": 1} and rx.stats().unchecked == 0
        _, _, _, fallbacks, _ = _ship(rx, tx, kv, "c2")
        assert fallbacks == [] and rx.stats().refused == {"checksum_required": 1}   # CRC'd from the start now
    finally:
        tx.stop()
        rx.stop()
    rx, tx = Receiver("grpc", "m", "float32", bind="127.0.0.1"), Sender("grpc")   # both auto: nothing to retry
    try:
        got, _, _, fallbacks, _ = _ship(rx, tx, kv, "c3")
        assert fallbacks == [] and rx.stats().unchecked == 1 and torch.equal(got.data, kv.data)
    finally:
        tx.stop()
        rx.stop()


def test_a_nixl_peer_that_cannot_be_loaded_falls_back_to_grpc():
    import dataclasses
    rx = Receiver("grpc", "m", "float32", bind="127.0.0.1")
    tx = Sender("auto")
    try:
        assert tx.nixl is not None                                    # NIXL runs on this machine
        ep = dataclasses.replace(rx.endpoint, transport="nixl", nixl_agent="ghost", nixl_metadata=b"not metadata")
        kv = _kv()
        grant, cred = TransferGrant.issue("p1", "m", "float32", kv.token_ids.tolist())
        rx.expect(grant)
        res = tx.send(ep, "p1", "m", kv, credential=cred, timeout=10)
        used, fallbacks = res.transport, list(res.fallbacks)
        assert used == "grpc" and fallbacks == ["kv_transport_nixl_to_grpc"]
        assert torch.equal(decode_block(rx.receive("p1", timeout=5), model="m").data, kv.data)
    finally:
        tx.stop()
        rx.stop()
