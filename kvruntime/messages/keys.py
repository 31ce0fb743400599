"""Content-addressed keys of the KV tier: :class:`ChunkKey` and the pieces it is made of.

A key is derived from the plan alone (docs/architecture.md, "State model"): model id, KV dtype, RoPE
fingerprint, canonical position of the first slot, the token ids (hashed), the prefix the chunk
was compiled after (hashed; "" for the default BOS anchor, see ``kvruntime.ops.frame``), the tenant's salt
(an HMAC of the tenant under a cluster secret), and whether the KV is exact (a full forward of
exactly these tokens from that position) or approximate (built by reposition, seam repair,
erratum or edit-in-place; tagged with a recipe digest so that ``exact`` never reads it and two
recipes never share it). Any prefill actor finds any chunk from a plan, after a restart too,
without a per-actor name map.

Torch-free: token hashing packs int64 little-endian with ``struct`` (same bytes as numpy).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import struct
from dataclasses import dataclass, field
from typing import Sequence

KEY_VERSION = "kvnotes-chunk-v2"   # bump when the key derivation changes: old entries then miss
KV_DTYPES = ("float32", "bfloat16", "float16")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")   # no '@', '%', '/': LMCache key separators
_HEX = re.compile(r"^[0-9a-f]+$")
_APPROX = re.compile(r"^[0-9a-f]{0,32}$")
_PREFIX = re.compile(r"^[0-9a-f]{64}$")


def check_model_id(model_id: str) -> str:
    """``model_id`` if usable in keys (LMCache key strings use '@', '%', '/' as separators)."""
    if not isinstance(model_id, str) or not _MODEL_ID.match(model_id):
        raise ValueError(f"model_id must match {_MODEL_ID.pattern}, got {model_id!r}")
    return model_id


def token_hash(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of the token ids as little-endian int64. Cost: O(n)."""
    ids = list(token_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def prefix_hash(prefix_ids: Sequence[int] | None) -> str:
    """The ``ChunkKey.prefix`` of a chunk compiled after ``prefix_ids``: "" for None (the default
    anchor, BOS alone), else :func:`token_hash` of the ids (an empty prefix hashes too: it is
    not the anchor on a model with BOS)."""
    return "" if prefix_ids is None else token_hash([int(t) for t in prefix_ids])


def tenant_salt(tenant: str, secret: bytes = b"") -> str:
    """The salt mixed into every key of ``tenant``: HMAC-SHA256(secret, tenant), 32 hex chars.
    With a server-side ``secret`` (the state store keeps one per cluster) a tenant cannot
    compute another tenant's keys."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    return hmac.new(secret, b"kvnotes-tenant:" + tenant.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one chunk's KV (like LMCache's ``CacheEngineKey``, plus tenant and exactness).

    Equality and hashing use every field except ``token_ids``, which ride along (they are what
    LMCache chunks and hashes); ``token_hash`` commits to them. Build keys with :meth:`build`.
    """
    model_id: str        # the weights: name + content hash, e.g. "smollm2-135m-1a2b3c4d5e6f7a8b"
    dtype: str           # KV dtype name: one of KV_DTYPES
    rope: str            # RoPE fingerprint of the model's rotary tables (hex)
    token_hash: str      # token_hash(token_ids): sha256 hex (64)
    num_tokens: int      # len(token_ids) > 0
    tenant: str          # tenant_salt() (hex), never the tenant's name
    position: int        # canonical position of the first slot (1 after a dropped BOS, else 0)
    approx: str = ""     # "" = exact KV; else the recipe digest of the approximate operation (hex)
    token_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)
    prefix: str = ""     # prefix_hash() of the tokens it was compiled after; "" = the default anchor (BOS)

    def __post_init__(self) -> None:
        check_model_id(self.model_id)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        for name in ("rope", "token_hash", "tenant"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _HEX.match(v):
                raise ValueError(f"{name} must be a lowercase hex string, got {v!r}")
        if not isinstance(self.prefix, str) or (self.prefix and not _PREFIX.match(self.prefix)):
            raise ValueError(f"prefix must be '' or a sha256 hex digest, got {self.prefix!r}")
        if not isinstance(self.approx, str) or not _APPROX.match(self.approx):
            raise ValueError(f"approx must be '' or a lowercase hex digest, got {self.approx!r}")
        if self.num_tokens <= 0:
            raise ValueError(f"a chunk needs at least one token, got num_tokens={self.num_tokens}")
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")
        if len(self.token_ids) != self.num_tokens:
            raise ValueError(f"token_ids has {len(self.token_ids)} ids but num_tokens={self.num_tokens}")

    @staticmethod
    def build(model_id: str, dtype: str, rope: str, token_ids: Sequence[int], tenant: str,
              position: int, approx: str = "", prefix: str = "") -> "ChunkKey":
        """Validated key for ``token_ids`` (ints >= 0). ``tenant`` is a salt from tenant_salt();
        ``prefix`` is prefix_hash() of the compile prefix ("" = the default anchor)."""
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            raise ValueError("cannot key an empty chunk (no token ids)")
        if min(ids) < 0:
            raise ValueError("token ids must be >= 0")
        return ChunkKey(model_id, dtype, rope, token_hash(ids), len(ids), tenant, int(position), approx, ids,
                        prefix)

    @property
    def exact(self) -> bool:
        return not self.approx

    @property
    def namespace(self) -> str:
        """128-bit digest of everything but the tokens: the tag LMCache keys carry. LMCache's own
        chained hash commits to the tokens piece by piece, so a stored entry also serves every
        prefix of it that ends on a piece boundary (plain-prompt prefix reuse)."""
        parts = [KEY_VERSION, self.model_id, self.dtype, self.rope, self.tenant, str(self.position),
                 self.approx or "exact"]
        if self.prefix:                      # absent for the default anchor: BOS-compiled keys unchanged
            parts.append("prefix:" + self.prefix)
        text = "|".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def digest(self) -> str:
        """128-bit hex digest of every identifying field (shown in listings and logs)."""
        return hashlib.sha256(f"{self.namespace}|{self.token_hash}|{self.num_tokens}".encode()).hexdigest()[:32]

    @property
    def positions(self) -> range:
        """The canonical positions of the chunk's slots."""
        return range(self.position, self.position + self.num_tokens)
