"""Test helper: throwaway certificate authorities made with ``cryptography`` for the TLS tests
(tests/test_grpc_tls.py: the gRPC KV data plane; tests/test_tier_tls.py: the lm:// tier)."""
from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_pki(tmp_path, name: str) -> dict:
    """A CA named ``{name} CA`` and a certificate (CN ``kvnotes``; names 127.0.0.1 and localhost)
    signed by it, valid for a day, as files under ``tmp_path`` (the key 0600, as the tier's TLS
    check demands): ``{"cert": path, "key": path, "ca": path}``."""
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
    os.chmod(files["key"], 0o600)
    return {k: str(v) for k, v in files.items()}
