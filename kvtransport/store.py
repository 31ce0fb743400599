"""The KV tier seam: :class:`ChunkKey` (what identifies a chunk's KV) and :class:`KVStore`
(the small interface every tier implements; LMCache behind it in ``lmcache_store``).

A chunk's KV is stored at its *canonical position* (see ``kvruntime.ops.precompile_chunk``):
prefilled right after the model's BOS, whose slot is dropped, so the chunk's slots sit at
positions ``1..n`` (``0..n-1`` for a model without BOS). The key hashes everything that changes
those bytes -- model, KV dtype, RoPE configuration, the token ids, the canonical position --
plus a tenant salt, so two tenants never share an entry even for identical text.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvruntime.kv import KVCache

KEY_VERSION = "kvnotes-chunk-v1"   # bump when the key derivation changes: old entries then miss
KV_DTYPES = ("float32", "bfloat16", "float16")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")   # no '@', '%', '/': LMCache key separators
_HEX = re.compile(r"^[0-9a-f]+$")


def check_model_id(model_id: str) -> str:
    """``model_id`` if usable in keys (LMCache key strings use '@', '%', '/' as separators)."""
    if not isinstance(model_id, str) or not _MODEL_ID.match(model_id):
        raise ValueError(f"model_id must match {_MODEL_ID.pattern}, got {model_id!r}")
    return model_id


def token_hash(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of the token ids as little-endian int64. Cost: O(n)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def rope_fingerprint(rope) -> str:
    """Short hash of a ``kvruntime.rope.RopeTable``: per-layer inverse frequencies (fp64 bytes)
    and head dim. Two models whose keys are rotated differently never share a fingerprint."""
    h = hashlib.sha256()
    h.update(rope.inv_freq.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    h.update(f"|{tuple(rope.inv_freq.shape)}|{rope.head_dim}".encode())
    return h.hexdigest()[:16]


def tenant_salt(tenant: str, secret: bytes = b"") -> str:
    """The salt mixed into every key of ``tenant``: HMAC-SHA256(secret, tenant), 32 hex chars.
    With a server-side ``secret`` a tenant cannot compute another tenant's keys."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    return hmac.new(secret, b"kvnotes-tenant:" + tenant.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one chunk's KV (like LMCache's ``CacheEngineKey``, plus a tenant).

    Equality and hashing use every field except ``token_ids``, which ride along (they are what
    LMCache chunks and hashes, and what a returned :class:`KVCache` carries); ``token_hash``
    commits to them. Build keys with :meth:`build` or :meth:`for_engine`, which validate.
    """
    model_id: str        # model registry name, e.g. "smollm2-135m"
    dtype: str           # KV dtype name: one of KV_DTYPES
    rope: str            # rope_fingerprint() of the model's RoPE table (16 hex)
    token_hash: str      # token_hash(token_ids): sha256 hex (64)
    num_tokens: int      # len(token_ids) > 0
    tenant: str          # tenant_salt() (hex), never the tenant's name
    position: int        # canonical position of the first slot (1 after BOS, else 0)
    token_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        check_model_id(self.model_id)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        for name in ("rope", "token_hash", "tenant"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _HEX.match(v):
                raise ValueError(f"{name} must be a lowercase hex string, got {v!r}")
        if self.num_tokens <= 0:
            raise ValueError(f"a chunk needs at least one token, got num_tokens={self.num_tokens}")
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")
        if len(self.token_ids) != self.num_tokens:
            raise ValueError(f"token_ids has {len(self.token_ids)} ids but num_tokens={self.num_tokens}")

    @staticmethod
    def build(model_id: str, dtype: str, rope: str, token_ids: Sequence[int], tenant: str,
              position: int) -> "ChunkKey":
        """Validated key for ``token_ids`` (ints >= 0). ``tenant`` is a salt from tenant_salt()."""
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            raise ValueError("cannot key an empty chunk (no token ids)")
        if min(ids) < 0:
            raise ValueError("token ids must be >= 0")
        return ChunkKey(model_id, dtype, rope, token_hash(ids), len(ids), tenant, int(position), ids)

    @staticmethod
    def for_engine(engine, token_ids: Sequence[int], tenant: str) -> "ChunkKey":
        """Key for a chunk precompiled by ``kvruntime.ops.precompile_chunk(engine, token_ids)``."""
        pos = 0 if engine.bos_id is None else 1
        return ChunkKey.build(engine.spec.name, engine.dtype_name, rope_fingerprint(engine.rope),
                              token_ids, tenant, pos)

    @property
    def digest(self) -> str:
        """128-bit hex digest of every identifying field (the tag LMCache keys carry)."""
        text = "|".join([KEY_VERSION, self.model_id, self.dtype, self.rope, self.token_hash,
                         str(self.num_tokens), self.tenant, str(self.position)])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def positions(self) -> torch.Tensor:
        """[num_tokens] int64: the canonical positions of the chunk's slots."""
        return torch.arange(self.position, self.position + self.num_tokens, dtype=torch.long)

    def check_kv(self, kv: KVCache) -> None:
        """``ValueError`` unless ``kv`` is this chunk at its canonical positions."""
        if kv.num_tokens != self.num_tokens:
            raise ValueError(f"KV has {kv.num_tokens} slots, key expects {self.num_tokens}")
        if not torch.equal(kv.token_ids.cpu(), torch.tensor(self.token_ids, dtype=torch.long)):
            raise ValueError("KV token ids differ from the key's token ids")
        if not torch.equal(kv.positions.cpu(), self.positions):
            raise ValueError(f"KV must sit at canonical positions {self.position}..."
                             f"{self.position + self.num_tokens - 1}")


class TierWriteError(RuntimeError):
    """put() left no tier holding the whole chunk (e.g. local CPU full and no other tier took it)."""


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters (what ``kvnotes_tier_*`` metrics export)."""
    lookups: int = 0                  # contains() calls
    lookup_hits: int = 0              # contains() calls that found the whole chunk
    gets: int = 0                     # get() calls
    hits: int = 0                     # get() calls that returned the whole chunk
    hits_by_tier: dict[str, int] = field(default_factory=dict)   # tier -> hits ("cpu", "disk", "fs", "remote", "mixed")
    misses: dict[str, int] = field(default_factory=dict)         # reason -> get() misses ("absent", "partial", "remote_down")
    lookup_misses: dict[str, int] = field(default_factory=dict)  # reason -> contains() misses (same reasons)
    puts: int = 0                     # put() calls that stored the chunk in at least one tier
    put_bytes: int = 0                # bytes of those chunks (once per put, not per tier)
    get_bytes: int = 0                # bytes returned by hits
    put_tier_failures: dict[str, int] = field(default_factory=dict)  # tier -> puts it did not confirm
    remote_errors: int = 0            # failed or timed-out remote operations
    remote_reconnects: int = 0        # times the remote tier came back
    remote_up: bool = False           # remote tier configured and in use right now
    evictions: int = 0                # evict() calls that removed the chunk from some tier
    remote_evict_unsupported: int = 0  # evictions the remote tier could not do (no delete)

    @property
    def remote_down_misses(self) -> int:
        return self.misses.get("remote_down", 0) + self.lookup_misses.get("remote_down", 0)


class KVStore(ABC):
    """A KV tier holding whole chunks by :class:`ChunkKey`.

    A chunk is all or nothing: ``get`` returns every slot or ``None`` (a partial hit is a miss).
    Misses are never errors: a caller recomputes. Implementations count every miss and every
    degraded path in ``stats``. Batched variants default to loops over the single-key methods.
    """

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """True if some tier holds the whole chunk. Copies nothing, mutates nothing but stats;
        may block on a remote round trip (bounded by the tier's timeout)."""

    @abstractmethod
    def put(self, key: ChunkKey, kv: KVCache) -> int:
        """Copy ``kv`` (validated against ``key``) into the tiers; returns bytes stored.
        Blocks until each configured tier confirmed the chunk or its timeout passed (a tier that
        did not confirm is counted). Raises :class:`TierWriteError` if no tier holds the whole
        chunk afterwards, ``ValueError`` if ``kv`` does not match ``key`` or the store."""

    @abstractmethod
    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> KVCache | None:
        """The chunk's KV at its canonical positions, or ``None``. Fills ``out`` when given (a
        ``[layers, 2, kv_heads, num_tokens, head_dim]`` tensor of the store's dtype; on a miss its
        contents are unspecified), else a new tensor the caller owns: allocating costs page faults,
        ~2 GB/s for fresh memory versus ~11 GB/s into warm memory (bench.tier_throughput).
        May copy the chunk into faster tiers (write-back); blocks on I/O, bounded."""

    @abstractmethod
    def pin(self, key: ChunkKey) -> bool:
        """Protect the chunk from the tier's own eviction (local tiers). Returns False if the
        chunk is not held locally. Pins nest: each pin needs an unpin."""

    @abstractmethod
    def unpin(self, key: ChunkKey) -> bool:
        """Undo one :meth:`pin`. Returns False if the chunk is not held locally."""

    @abstractmethod
    def evict(self, key: ChunkKey) -> bool:
        """Remove the chunk from every tier that supports removal (pins are released).
        Returns True if any tier held it."""

    @property
    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the counters (cheap; no I/O)."""

    def close(self) -> None:
        """Release resources (threads, sockets). The store is unusable afterwards."""

    # ---- batched variants: defaults built on the single-key methods -------------------------
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def put_many(self, items: Sequence[tuple[ChunkKey, KVCache]]) -> int:
        return sum(self.put(k, kv) for k, kv in items)

    def get_many(self, keys: Sequence[ChunkKey]) -> list[KVCache | None]:
        return [self.get(k) for k in keys]

    def evict_many(self, keys: Sequence[ChunkKey]) -> int:
        return sum(bool(self.evict(k)) for k in keys)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
