"""The gRPC KV data plane over TLS by config (issue 45, item 4), between real gRPC servers: a
push with the cluster's certificate, key and CA is delivered and verified; a sender without TLS,
or with a certificate of another CA, is refused by the TLS server; certificates made here with
``cryptography`` (a throwaway CA)."""
from __future__ import annotations

import pytest
import torch

from kvruntime.kv import KVCache
from kvtransport.transfer.blocks import decode_block, encode_block
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.interface import TransferError
from tests.certs import make_pki as _pki


def _tls(p: dict, **kw) -> GrpcTransportConfig:
    return GrpcTransportConfig(tls_cert_file=p["cert"], tls_key_file=p["key"], tls_ca_file=p["ca"], pool_bytes=0, **kw)


def _kv(tokens=40):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(2, 2, 2, tokens, 32, generator=g), torch.arange(tokens), torch.arange(100, 100 + tokens))


def test_pushes_over_tls_and_refusals_without_the_clusters_certificate(tmp_path):
    ours, theirs = _pki(tmp_path, "cluster"), _pki(tmp_path, "other")
    rx = GrpcTransport(_tls(ours), model="m")
    addr = rx.serve("127.0.0.1")
    senders = {"ours": GrpcTransport(_tls(ours)), "plain": GrpcTransport(GrpcTransportConfig()),
               "other": GrpcTransport(_tls(theirs))}
    try:
        kv = _kv()
        senders["ours"].send(addr, encode_block("tls-1", "m", kv), timeout=20)
        assert torch.equal(decode_block(rx.receive("tls-1", timeout=5)).data, kv.data)
        for name in ("plain", "other"):
            with pytest.raises(TransferError) as info:
                senders[name].send(addr, encode_block(f"{name}-1", "m", kv), timeout=5)
            assert info.value.reason in ("unavailable", "timeout", "rpc_error"), (name, info.value)
        assert rx.stats().pending == 0 and rx.stats().blocks == 0
    finally:
        for t in senders.values():
            t.stop()
        rx.stop()


def test_tls_settings_go_together():
    with pytest.raises(ValueError, match="tls_cert_file, tls_key_file and tls_ca_file"):
        GrpcTransportConfig(tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="tls_key_file: cannot read"):
        GrpcTransportConfig(tls_cert_file="/no/c.pem", tls_key_file="/no/k", tls_ca_file="/no/ca").server_credentials()
