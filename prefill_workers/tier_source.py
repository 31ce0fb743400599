"""Adapter between the plan's string tier keys and the tier's :class:`ChunkKey` values.

The router names KV by opaque strings (chunk keys, session-context keys, prompt-prefix keys);
the tier needs the full :class:`ChunkKey` (tokens, canonical position, tenant salt). This
worker remembers which ChunkKey each string it stored stands for. A string it never stored
is a miss (the executor then takes its counted fallback).
"""
from __future__ import annotations

import threading

from kvruntime.kv import KVCache
from kvtransport.store import ChunkKey, KVStore, rope_fingerprint, tenant_salt


class TierSource:
    def __init__(self, store: KVStore, engine, *, max_keys: int = 100_000):
        self.store, self.engine = store, engine
        self._rope = rope_fingerprint(engine.rope)
        self._keys: dict[str, ChunkKey] = {}     # plan key -> tier key
        self._lock = threading.Lock()
        self._max = max_keys

    def _key(self, token_ids, position: int, tenant: str) -> ChunkKey:
        return ChunkKey.build(self.engine.spec.name, self.engine.dtype_name, self._rope, token_ids,
                              tenant_salt(tenant), position)

    def _remember(self, name: str, key: ChunkKey) -> None:
        with self._lock:
            self._keys[name] = key
            while len(self._keys) > self._max:
                self._keys.pop(next(iter(self._keys)))

    def put_chunk(self, name: str, token_ids, kv: KVCache, tenant: str) -> int:
        """Store a precompiled chunk (canonical positions) under ``name``; returns bytes."""
        key = self._key(token_ids, int(kv.positions[0]), tenant)
        n = self.store.put(key, kv)
        self._remember(name, key)
        return n

    def contains(self, name: str) -> bool:
        with self._lock:
            key = self._keys.get(name)
        return key is not None and self.store.contains(key)

    def evict(self, name: str) -> bool:
        with self._lock:
            key = self._keys.pop(name, None)
        return key is not None and self.store.evict(key)

    # KVSource protocol (prefill_workers.executor)
    def get_kv(self, name: str) -> KVCache | None:
        with self._lock:
            key = self._keys.get(name)
        return None if key is None else self.store.get(key)

    def put_kv(self, name: str, kv: KVCache, tenant: str = "default") -> None:
        self.put_chunk(name, kv.token_ids.tolist(), kv, tenant)
