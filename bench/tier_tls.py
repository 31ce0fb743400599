"""The ``lm://`` tier over TLS (``kvtransport.tier.tls``: a loopback tunnel per store, a terminator
in the server) against plain ``lm://``, side by side in one run: store and retrieve GB/s of the
same chunks, the two servers started and stopped by this script on 127.0.0.1, the runs
interleaved (plain, TLS, plain, TLS ...) so that load drifts hit both.

    python -m bench.tier_tls [--tokens 1024,4096] [--repeats 3]

KV is synthetic with SmolLM2-135M's shape (fp32, 45 KiB per token); ``local_cpu=False`` so every
get is served by the remote tier. Certificates: a throwaway CA made with ``cryptography`` in a
temporary directory. GB/s = 1e9 bytes/s, best of ``--repeats``.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import tempfile
import time
from pathlib import Path

import torch

from kvruntime.config import TierConfig
from kvruntime.config.tier import TierTLS
from kvruntime.kv import KVCache
from kvtransport.tier.auth import tier_key
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.server import start_tier_server, stop_tier_server
from kvtransport.tier.store import ChunkKey, key_positions, tenant_salt

LAYERS, KV_HEADS, HEAD_DIM, MODEL = 30, 3, 64, "smollm2-135m"
KEY = tier_key(os.urandom(32))


def throwaway_pki(d: Path) -> TierTLS:
    """A CA and a certificate for 127.0.0.1 signed by it, in ``d`` (the key 0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca = (x509.CertificateBuilder(subject_name=name, issuer_name=name, public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder(subject_name=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tier")]),
                                    issuer_name=name, public_key=key.public_key(),
                                    serial_number=x509.random_serial_number(), **valid)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False).sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "tier.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(d / "tier.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return TierTLS(str(d / "ca.pem"), str(d / "tier.pem"), str(d / "tier.key"))


def _store(url: str, tls: TierTLS | None, gb: float) -> LMCacheStore:
    extra = {} if tls is None else {"remote_tls_ca_file": tls.ca_file, "remote_tls_cert_file": tls.cert_file,
                                    "remote_tls_key_file": tls.key_file}
    return LMCacheStore(MODEL, "float32", LAYERS, KV_HEADS, HEAD_DIM,
                        TierConfig(local_cpu=False, cpu_bytes=int(gb * 2**30), remote_url=url, remote_timeout_s=30,
                                   remote_probe_s=None, **extra), remote_key=KEY)


def _one(store: LMCacheStore, data: torch.Tensor, seq: int, dst: torch.Tensor) -> tuple[float, float]:
    n = data.shape[3]
    key = ChunkKey.build(MODEL, "float32", "0", range(seq * 100_000, seq * 100_000 + n), tenant_salt("bench"), 1)
    kv = KVCache(data, key_positions(key), torch.tensor(key.token_ids))
    t0 = time.perf_counter()
    store.put(key, kv)
    t1 = time.perf_counter()
    got = store.get(key, out=dst)
    t2 = time.perf_counter()
    if got is None or not torch.equal(dst, data) or store.stats.put_tier_failures:
        raise RuntimeError(f"a {n}-token chunk did not round-trip through the remote tier: {store.stats}")
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(1)
    gb = 2.2 * max(tokens) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4 / 2**30 + 0.1
    with tempfile.TemporaryDirectory(prefix="kvnotes-tier-tls-bench-") as tmp:
        tls = throwaway_pki(Path(tmp))
        cap = int(4 * gb * 2**30)
        servers = {"plain": start_tier_server(key=KEY, capacity_bytes=cap, log_path=Path(tmp) / "plain.log"),
                   "tls": start_tier_server(key=KEY, capacity_bytes=cap, log_path=Path(tmp) / "tls.log", tls=tls)}
        stores = {}
        try:
            stores = {k: _store(s.url, tls if k == "tls" else None, gb) for k, s in servers.items()}
            print(f"lm:// plain vs TLS on 127.0.0.1 (fp32 {MODEL} shape, best of {args.repeats}, interleaved; "
                  f"GB = 1e9 bytes; load {os.getloadavg()[0]:.1f})")
            print(f"{'tokens':>7}{'MiB':>7}{'store plain':>13}{'store TLS':>11}{'TLS/plain':>10}"
                  f"{'get plain':>11}{'get TLS':>9}{'TLS/plain':>10}")
            seq = 0
            for n in tokens:
                data = torch.randn(LAYERS, 2, KV_HEADS, n, HEAD_DIM)
                dst = torch.empty_like(data)
                best = {k: [float("inf"), float("inf")] for k in stores}
                for _ in range(args.repeats):
                    for k, st in stores.items():
                        seq += 1
                        put_s, get_s = _one(st, data, seq, dst)
                        best[k] = [min(best[k][0], put_s), min(best[k][1], get_s)]
                g = {k: [data.nbytes / s / 1e9 for s in v] for k, v in best.items()}
                print(f"{n:>7}{data.nbytes / 2**20:>7.1f}{g['plain'][0]:>13.3f}{g['tls'][0]:>11.3f}"
                      f"{g['tls'][0] / g['plain'][0]:>10.2f}{g['plain'][1]:>11.3f}{g['tls'][1]:>9.3f}"
                      f"{g['tls'][1] / g['plain'][1]:>10.2f}")
        finally:
            for st in stores.values():
                st.close()
            for s in servers.values():
                stop_tier_server(s)


if __name__ == "__main__":
    main()
