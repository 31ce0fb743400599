"""The KV tier seam: :class:`KVStore` (the small interface every tier implements; LMCache behind
it in ``lmcache_store``) and the torch-side helpers of :class:`ChunkKey` (the key itself is a
torch-free message in ``kvruntime.messages.keys``).

A chunk's KV is stored at its *canonical position* (see ``kvruntime.ops.precompile_chunk``):
prefilled right after the model's BOS, whose slot is dropped, so the chunk's slots sit at
positions ``1..n`` (``0..n-1`` for a model without BOS). The key hashes everything that changes
those bytes -- model, KV dtype, RoPE configuration, the token ids, the canonical position --
plus a tenant salt, so two tenants never share an entry even for identical text.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvruntime.kv import KVCache
from kvruntime.messages.keys import (KEY_VERSION, KV_DTYPES, ChunkKey, check_model_id,  # noqa: F401 (re-exported)
                                     prefix_hash, tenant_salt, token_hash)
from kvruntime.messages.plan import KVRef

def rope_fingerprint(rope) -> str:
    """Short hash of a ``kvruntime.rope.RopeTable``: per-layer inverse frequencies (fp64 bytes)
    and head dim. Two models whose keys are rotated differently never share a fingerprint."""
    h = hashlib.sha256()
    h.update(rope.inv_freq.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    h.update(f"|{tuple(rope.inv_freq.shape)}|{rope.head_dim}".encode())
    return h.hexdigest()[:16]


def key_for(engine, ref: KVRef) -> ChunkKey:
    """The tier key of ``ref`` (a plan's content reference) for ``engine``'s weights (``model_id``:
    name and content hash), KV dtype and RoPE tables, and the prefix the chunk was compiled after:
    the whole derivation, so any worker finds any chunk from the plan alone."""
    return ChunkKey.build(engine.model_id, engine.dtype_name, rope_fingerprint(engine.rope), ref.token_ids,
                          ref.tenant_salt, ref.position, ref.approx, prefix_hash(ref.prefix))


def key_positions(key: ChunkKey, device=None) -> torch.Tensor:
    """[num_tokens] int64: the canonical positions of the chunk's slots."""
    return torch.arange(key.position, key.position + key.num_tokens, dtype=torch.long, device=device)


def check_kv(key: ChunkKey, kv: KVCache) -> None:
    """``ValueError`` unless ``kv`` is this chunk at its canonical positions."""
    if kv.num_tokens != key.num_tokens:
        raise ValueError(f"KV has {kv.num_tokens} slots, key expects {key.num_tokens}")
    if not torch.equal(kv.token_ids.cpu(), torch.tensor(key.token_ids, dtype=torch.long)):
        raise ValueError("KV token ids differ from the key's token ids")
    if not torch.equal(kv.positions.cpu(), key_positions(key)):
        raise ValueError(f"KV must sit at canonical positions {key.position}..."
                         f"{key.position + key.num_tokens - 1}")


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
    remote_auth_refusals: int = 0     # attaches or probes the tier server refused (wrong tier key, TLS failed)
    remote_tls_connections: int = 0   # TLS connections made to the tier (tunnel and probes; tier_remote_tls_*)
    remote_tls_handshake_failures: int = 0  # TLS handshakes with the tier that failed (certificate, protocol, ...)
    remote_last_error: str = ""       # why the remote tier last went down (one line)
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
