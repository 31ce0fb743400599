"""Who may use the ``lm://`` tier server: a challenge-response on every connection, keyed by the
cluster secret, before any LMCache byte is exchanged.

The key is never the cluster secret itself but :func:`tier_key` = HMAC-SHA256(secret,
"kvnotes-tier-key"), like ``kvruntime.messages.keys.tenant_salt``: the tier server holds only what
it needs, and a leaked tier key salts no tenant's KV. Neither the key nor the secret crosses the
wire:

1. server -> client, on accept: ``MAGIC`` (8 bytes) + a fresh random nonce (32 bytes);
2. client -> server: HMAC-SHA256(key, "kvnotes-tier-auth:" + nonce) (32 bytes);
3. server -> client: ``OK`` (1 byte), then LMCache's own protocol on the same socket; or ``NO``
   and the server closes the connection (counted by reason: ``bad_proof`` for a wrong key or a
   client that does not speak this handshake, ``no_proof`` for one that sends nothing in time).

A stock LMCache client (no handshake) sends its first command where the proof belongs: refused.
No encryption: the KV bytes themselves travel in clear, as on the gRPC data plane.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

MAGIC = b"KVNTIER1"              # protocol marker and version
NONCE_BYTES = 32
PROOF_BYTES = 32                 # SHA-256
OK, NO = b"\x01", b"\x00"
KEY_ENV = "KVNOTES_TIER_KEY"     # hex tier key handed to a child server by start_tier_server (not argv: ps shows argv)


class TierAuthError(ConnectionError):
    """The tier server refused this client's proof (a different cluster secret), or the peer is
    not a kvnotes tier server."""


def tier_key(cluster_secret: bytes) -> bytes:
    """The ``lm://`` tier's 32-byte key for a cluster secret (``cluster.state``'s ``secret()``)."""
    if not isinstance(cluster_secret, bytes) or len(cluster_secret) < 16:
        raise ValueError("the cluster secret must be at least 16 bytes")
    return hmac.new(cluster_secret, b"kvnotes-tier-key", hashlib.sha256).digest()


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError("a tier key is 32 bytes (kvtransport.tier.auth.tier_key of the cluster secret)")
    return key


def proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"kvnotes-tier-auth:" + nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def client_handshake(sock: socket.socket, key: bytes, where: str) -> None:
    """Answer the server's challenge on a connected socket (its timeout bounds each read).
    Raises :class:`TierAuthError` when refused or when the peer is not a kvnotes tier server,
    ``OSError`` (e.g. ``socket.timeout``) on network failures."""
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if hello is None:
        raise ConnectionError(f"the lm:// tier server at {where} closed the connection before its challenge")
    if hello[:len(MAGIC)] != MAGIC:
        raise TierAuthError(f"{where} is not a kvnotes lm:// tier server (no {MAGIC.decode()} challenge): "
                            "start it with `python -m kvtransport.tier.server` or `kvnotes tier-server`")
    sock.sendall(proof(key, hello[len(MAGIC):]))
    verdict = _recv_exactly(sock, 1)
    if verdict != OK:
        raise TierAuthError(f"the lm:// tier server at {where} refused this process' tier key: its cluster "
                            "secret differs (start the server from the same state store, `kvnotes tier-server`)")


def server_handshake(sock: socket.socket, key: bytes, timeout_s: float) -> str | None:
    """Challenge a freshly accepted client. None when it proved the key (the socket is then left
    blocking, as LMCache's handler expects), else the refusal reason (``bad_proof`` or
    ``no_proof``); the caller closes the socket."""
    nonce = os.urandom(NONCE_BYTES)
    sock.settimeout(timeout_s)
    try:
        sock.sendall(MAGIC + nonce)
        got = _recv_exactly(sock, PROOF_BYTES)
        if got is None:
            return "no_proof"
        if not hmac.compare_digest(got, proof(key, nonce)):
            try:
                sock.sendall(NO)
            except OSError:
                pass
            return "bad_proof"
        sock.sendall(OK)
    except OSError:      # timed out or reset before a whole proof arrived
        return "no_proof"
    sock.settimeout(None)
    return None
