"""Precompile skills and memories into the KV tier, and find them again by name.

``Precompiler.precompile(name, text, kind, tenant)`` tokenizes ``text``, keys it
(``ChunkKey.for_engine``: model, dtype, RoPE, token ids, tenant salt, canonical position), and
prefills it at its canonical position (``kvruntime.ops.precompile_chunk``) only if the tier does
not already hold that key: idempotent by content, across names, processes and restarts.
A capacity limit (bytes and/or entries) is enforced by evicting least-recently-used, unpinned
names first; evicted names are returned with the result and kept in ``evictions``.
``load`` returns a chunk's KV from the tier or, on a miss (absent, evicted, remote down),
recomputes it (counted in ``recomputes``) and stores it back.
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvruntime.kv import KVCache
from kvruntime.ops import precompile_chunk
from kvtransport.store import ChunkKey, KVStore, TierWriteError, tenant_salt
from prefill_workers.registry import ChunkRegistry, Ident, RegistryEntry

log = logging.getLogger(__name__)

KINDS = ("skill", "memory")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class UnknownChunkError(KeyError):
    """No chunk of that (tenant, kind, name) is registered (a caller's mistake: HTTP 404)."""

    def __str__(self) -> str:   # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CapacityError(RuntimeError):
    """The capacity limit cannot be met: everything left is pinned."""


@dataclass(frozen=True)
class PrecompileResult:
    name: str
    kind: str
    tenant: str
    key: ChunkKey
    num_tokens: int              # tokens in the chunk
    nbytes: int                  # KV bytes of the chunk
    seconds: float               # wall time of this call
    created: bool                # False: the tier already held this content (no prefill ran)
    evicted: tuple[str, ...]     # "tenant/kind/name" of entries evicted to make room


@dataclass(frozen=True)
class LoadResult:
    kv: KVCache                              # canonical positions 1..n (0..n-1 without BOS)
    source: Literal["tier", "recomputed"]
    seconds: float


@dataclass(frozen=True)
class EvictionRecord:
    name: str
    kind: str
    tenant: str
    nbytes: int
    at: float                                # unix seconds

    @property
    def label(self) -> str:
        return f"{self.tenant}/{self.kind}/{self.name}"


class Precompiler:
    """Prefill-side registry of named chunks over a :class:`KVStore`. Thread-safe (one lock).

    ``registry_path`` defaults to ``<persist_dir>/kvnotes-registry-<model>.json`` when the store
    has an ``fs://`` tier (so a restart finds the names), else the registry lives in memory.
    ``tenant_secret`` keys the tenant salts (see ``kvtransport.store.tenant_salt``).
    """

    def __init__(self, engine, store: KVStore, *, max_bytes: int | None = None,
                 max_entries: int | None = None, registry_path: str | Path | None = None,
                 tenant_secret: bytes = b""):
        if max_bytes is not None and max_bytes <= 0 or max_entries is not None and max_entries <= 0:
            raise ValueError("max_bytes and max_entries must be > 0 when given")
        probe = ChunkKey.for_engine(engine, [0], tenant_salt("probe"))
        for attr in ("model_id", "dtype", "rope"):
            mine, theirs = getattr(probe, attr), getattr(store, attr, None)
            if theirs is not None and theirs != mine:
                raise ValueError(f"store {attr}={theirs!r} does not match the engine's {mine!r}")
        persist = getattr(getattr(store, "config", None), "persist_dir", None)
        if registry_path is None and persist:
            registry_path = Path(persist) / f"kvnotes-registry-{engine.spec.name}.json"
        self.engine, self.store = engine, store
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.registry = ChunkRegistry(registry_path)
        self._secret = tenant_secret
        self._lock = threading.RLock()
        self._evictions: deque[EvictionRecord] = deque(maxlen=1000)
        self.recomputes = 0          # load() misses served by a prefill
        self.store_failures = 0      # recomputed KV the tier could not take back
        self._drop_stale(probe)

    # ---- API ----------------------------------------------------------------------------------
    def precompile(self, name: str, text: str, kind: str = "skill", tenant: str = "default") -> PrecompileResult:
        """Register ``text`` under ``name``; prefill it unless the tier holds the same content.
        Raises ``ValueError`` for bad input (empty text, over the context window, bad names, or
        a chunk larger than ``max_bytes``) and ``CapacityError`` if pinned entries fill the limit."""
        ident = self._ident(name, kind, tenant)
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        t0 = time.perf_counter()
        ids = self.engine.encode(text)
        limit = self.engine.spec.context_window - (self.engine.bos_id is not None)
        if not ids or len(ids) > limit:
            raise ValueError(f"{kind} {name!r} has {len(ids)} tokens; must be 1..{limit} for {self.engine.spec.name}")
        key = ChunkKey.for_engine(self.engine, ids, tenant_salt(tenant, self._secret))
        nbytes = self._nbytes(len(ids))
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise ValueError(f"{kind} {name!r} needs {nbytes} bytes of KV, over the limit of {self.max_bytes}")
        with self._lock:
            old = self.registry.get(ident)
            evicted = self._make_room(ident, key, nbytes)
            created = not self.store.contains(key)
            if created:
                self.store.put(key, precompile_chunk(self.engine, ids))
            now = time.time()
            self.registry.add(RegistryEntry(name, kind, tenant, key, hashlib.sha256(text.encode()).hexdigest(),
                                            nbytes, old.created_at if old and old.key == key else now, now,
                                            bool(old and old.pinned)))
            if old is not None and old.key != key:
                self._release(old.key)
        return PrecompileResult(name, kind, tenant, key, len(ids), nbytes, time.perf_counter() - t0,
                                created, tuple(e.label for e in evicted))

    def get(self, name: str, kind: str = "skill", tenant: str = "default") -> KVCache | None:
        """The chunk's KV from the tier, or ``None`` on a tier miss. ``UnknownChunkError`` if the
        name is not registered for this tenant."""
        with self._lock:
            entry = self._entry(name, kind, tenant)
            self.registry.update(entry.ident, last_used=time.time())
            return self.store.get(entry.key)

    def load(self, name: str, kind: str = "skill", tenant: str = "default") -> LoadResult:
        """The chunk's KV from the tier, else recomputed (one prefill, counted in ``recomputes``)
        and stored back. ``UnknownChunkError`` if the name is not registered for this tenant."""
        t0 = time.perf_counter()
        kv = self.get(name, kind, tenant)
        if kv is not None:
            return LoadResult(kv, "tier", time.perf_counter() - t0)
        entry = self._entry(name, kind, tenant)
        kv = precompile_chunk(self.engine, list(entry.key.token_ids))
        with self._lock:
            self.recomputes += 1
            try:
                self.store.put(entry.key, kv)
            except TierWriteError as e:      # the caller still gets its KV; the tier stays without it
                self.store_failures += 1
                if self.store_failures == 1:
                    log.warning("could not store recomputed KV back into the tier (counted in "
                                "store_failures): %s", e)
        return LoadResult(kv, "recomputed", time.perf_counter() - t0)

    def list(self, kind: str | None = None, tenant: str | None = None) -> list[RegistryEntry]:
        """Registered entries (optionally of one kind / tenant), sorted by (tenant, kind, name)."""
        with self._lock:
            return sorted((e for e in self.registry.entries()
                           if (kind is None or e.kind == kind) and (tenant is None or e.tenant == tenant)),
                          key=lambda e: e.ident)

    def delete(self, name: str, kind: str = "skill", tenant: str = "default") -> bool:
        """Forget the name; its KV is evicted from the tier unless another name shares it."""
        with self._lock:
            entry = self.registry.remove(self._ident(name, kind, tenant))
            if entry is None:
                return False
            self._release(entry.key)
            return True

    def pin(self, name: str, kind: str = "skill", tenant: str = "default") -> None:
        """Exempt a name from capacity eviction (and pin its KV in the local tiers)."""
        self._set_pinned(name, kind, tenant, True)

    def unpin(self, name: str, kind: str = "skill", tenant: str = "default") -> None:
        self._set_pinned(name, kind, tenant, False)

    @property
    def evictions(self) -> list[EvictionRecord]:
        """Capacity evictions, oldest first (the last 1000)."""
        return list(self._evictions)

    @property
    def used_bytes(self) -> int:
        return self.registry.used_bytes()

    def close(self) -> None:
        """Persist LRU times (when the registry has a file)."""
        with self._lock:
            self.registry.save()

    # ---- internals ----------------------------------------------------------------------------
    def _ident(self, name: str, kind: str, tenant: str) -> Ident:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"name must match {_NAME.pattern}, got {name!r}")
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise ValueError(f"tenant must match {_TENANT.pattern}, got {tenant!r}")
        return (tenant, kind, name)

    def _set_pinned(self, name: str, kind: str, tenant: str, pinned: bool) -> None:
        with self._lock:
            entry = self._entry(name, kind, tenant)
            if entry.pinned != pinned:
                (self.store.pin if pinned else self.store.unpin)(entry.key)
                self.registry.update(entry.ident, pinned=pinned)
                self.registry.save()

    def _entry(self, name: str, kind: str, tenant: str) -> RegistryEntry:
        entry = self.registry.get(self._ident(name, kind, tenant))
        if entry is None:
            raise UnknownChunkError(f"no {kind} named {name!r} for tenant {tenant!r}")
        return entry

    def _nbytes(self, n: int) -> int:
        e = self.engine
        return e.num_layers * 2 * e.kv_heads * n * e.head_dim * e.dtype.itemsize

    def _make_room(self, ident: Ident, key: ChunkKey, nbytes: int) -> list[EvictionRecord]:
        """Evict LRU unpinned entries (never ``ident``) until ``key`` fits both limits."""
        def over() -> bool:
            others = [e for e in self.registry.entries() if e.ident != ident]
            used = sum({e.key: e.nbytes for e in others}.values())
            extra = 0 if any(e.key == key for e in others) else nbytes
            return (self.max_bytes is not None and used + extra > self.max_bytes or
                    self.max_entries is not None and len(others) + 1 > self.max_entries)
        evicted: list[EvictionRecord] = []
        for victim in self.registry.lru():
            if not over():
                break
            if victim.ident == ident or victim.pinned or victim.key == key:
                continue
            self.registry.remove(victim.ident)
            self._release(victim.key)
            rec = EvictionRecord(victim.name, victim.kind, victim.tenant, victim.nbytes, time.time())
            evicted.append(rec)
            self._evictions.append(rec)
            log.info("evicted %s (%d bytes) to make room", rec.label, rec.nbytes)
        if over():
            raise CapacityError(f"cannot fit {nbytes} bytes: the remaining entries are pinned "
                                f"(limit {self.max_bytes} bytes / {self.max_entries} entries)")
        return evicted

    def _release(self, key: ChunkKey) -> None:
        if not self.registry.referenced(key):
            self.store.evict(key)

    def _drop_stale(self, probe: ChunkKey) -> None:
        """Forget persisted entries keyed for another model/dtype/RoPE (their KV never matches)."""
        stale = [e for e in self.registry.entries()
                 if (e.key.model_id, e.key.dtype, e.key.rope) != (probe.model_id, probe.dtype, probe.rope)]
        for e in stale:
            self.registry.remove(e.ident)
        if stale:
            log.warning("dropped %d registry entries keyed for another model/dtype/RoPE", len(stale))
