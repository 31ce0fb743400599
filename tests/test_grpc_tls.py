"""The gRPC KV data plane over TLS by config (issue 45, item 4), between real gRPC servers: a
push with the cluster's certificate, key and CA is delivered and verified; a sender without TLS,
or with a certificate of another CA, is refused by the TLS server; certificates made here with
``cryptography`` (a throwaway CA)."""
from __future__ import annotations

import datetime
import ipaddress

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvruntime.kv import KVCache
from kvtransport.transfer.blocks import decode_block, encode_block
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.interface import TransferError


def _pki(tmp_path, name: str) -> dict:
    """A CA and a certificate for 127.0.0.1 signed by it, as files: {cert, key, ca}."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvnotes")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"cert": tmp_path / f"{name}.pem", "key": tmp_path / f"{name}.key", "ca": tmp_path / f"{name}-ca.pem"}
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in files.items()}


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
