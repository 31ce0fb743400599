"""Who may use the ``lm://`` tier server, and which server a client may trust: a mutual
challenge-response on every connection, keyed by the cluster secret, before any LMCache byte is
exchanged.

The key is never the cluster secret itself but :func:`tier_key` = HMAC-SHA256(secret,
"kvnotes-tier-key"), like ``kvruntime.messages.keys.tenant_salt``: the tier server holds only what
it needs, and a leaked tier key salts no tenant's KV. Neither the key nor the secret crosses the
wire:

1. server -> client, on accept: ``MAGIC`` (8 bytes) + a fresh random server nonce ``Ns`` (32 bytes);
2. client -> server: a fresh client nonce ``Nc`` (32 bytes) + HMAC-SHA256(key, "client" | Ns | Nc |
   channel) (32 bytes);
3. server -> client: ``OK`` (1 byte) + HMAC-SHA256(key, "server" | Ns | Nc | channel) (32 bytes),
   then LMCache's own protocol on the same socket; or ``NO`` and the server closes the connection
   (counted by reason: ``bad_proof`` for a wrong key, a client that does not speak this
   handshake or a proof replayed from another connection, ``no_proof`` for one that sends nothing
   in time).
4. the client checks the server's proof and refuses a server that cannot give it
   (:class:`TierAuthError`): whoever answers at the tier's address without the key (a process that
   took the port after a restart, a redirected name) never gets a lookup or serves forged KV.

Both proofs cover both nonces, so neither is valid on another connection (a recorded client
proof replayed to the server fails: the server's nonce differs); the labels keep a proof of one
role from passing as the other's. The proofs carry a channel binding (``tcp``) so that a TLS
session could be bound in the same place; it is not: with ``tier_remote_tls_*`` the handshake
runs inside TLS that ``kvtransport.tier.tls`` adds around LMCache (a tunnel and a terminator, on
loopback at both ends), where neither end of this handshake sees the TLS session. On plain TCP a
relay that passes the handshake through could read and change what follows, and the KV bytes
travel in clear: across hosts use TLS, or a private network (docs/deploy.md, "Security").
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

MAGIC = b"KVNTIER2"              # protocol marker and version (2: the server proves the key too)
NONCE_BYTES = 32
PROOF_BYTES = 32                 # SHA-256
OK, NO = b"\x01", b"\x00"
CHANNEL = b"tcp"                 # the channel binding of a plain TCP connection (see the module doc)
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


def proof(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes, channel: bytes = CHANNEL) -> bytes:
    """The proof of ``role`` (``b"client"`` or ``b"server"``) on the connection these nonces and
    this channel binding belong to."""
    msg = b"kvnotes-tier-auth/2:" + role + b":" + server_nonce + client_nonce + b":" + channel
    return hmac.new(key, msg, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def client_handshake(sock: socket.socket, key: bytes, where: str) -> None:
    """Answer the server's challenge on a connected socket and check the server's own proof (the
    socket's timeout bounds each read). Raises :class:`TierAuthError` when refused, when the peer
    is not a kvnotes tier server, or when it cannot prove the tier key; ``OSError`` (e.g.
    ``socket.timeout``) on network failures."""
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if hello is None:
        raise ConnectionError(f"the lm:// tier server at {where} closed the connection before its challenge")
    if hello[:len(MAGIC)] != MAGIC:
        raise TierAuthError(f"{where} is not a kvnotes lm:// tier server (no {MAGIC.decode()} challenge): "
                            "start it with `python -m kvtransport.tier.server` or `kvnotes tier-server`")
    ns, nc, channel = hello[len(MAGIC):], os.urandom(NONCE_BYTES), CHANNEL
    sock.sendall(nc + proof(key, b"client", ns, nc, channel))
    verdict = _recv_exactly(sock, 1)
    if verdict != OK:
        raise TierAuthError(f"the lm:// tier server at {where} refused this process' tier key: its cluster "
                            "secret differs (start the server from the same state store, `kvnotes tier-server`)")
    theirs = _recv_exactly(sock, PROOF_BYTES)
    if theirs is None or not hmac.compare_digest(theirs, proof(key, b"server", ns, nc, channel)):
        raise TierAuthError(f"the lm:// server at {where} did not prove the tier key: refusing it (not this "
                            "cluster's tier server, or a relay between)")


def server_handshake(sock: socket.socket, key: bytes, timeout_s: float) -> str | None:
    """Challenge a freshly accepted client and prove the key back. None when it proved the key
    (the socket is then left blocking, as LMCache's handler expects), else the refusal reason
    (``bad_proof`` or ``no_proof``); the caller closes the socket. A proof recorded on another
    connection is a ``bad_proof`` here: it covers that connection's server nonce, not this one's."""
    ns = os.urandom(NONCE_BYTES)
    sock.settimeout(timeout_s)
    try:
        sock.sendall(MAGIC + ns)
        got = _recv_exactly(sock, NONCE_BYTES + PROOF_BYTES)
        if got is None:
            return "no_proof"
        nc, channel = got[:NONCE_BYTES], CHANNEL
        if not hmac.compare_digest(got[NONCE_BYTES:], proof(key, b"client", ns, nc, channel)):
            try:
                sock.sendall(NO)
            except OSError:
                pass
            return "bad_proof"
        sock.sendall(OK + proof(key, b"server", ns, nc, channel))
    except OSError:      # timed out or reset before a whole proof arrived
        return "no_proof"
    sock.settimeout(None)
    return None
