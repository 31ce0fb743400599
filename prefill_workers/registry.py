"""Names of precompiled chunks: ``(tenant, kind, name) -> RegistryEntry`` (the tier only knows
keys). Kept in memory, optionally persisted as one JSON file so a restarted process finds its
names again (next to the ``fs://`` tier by default; see ``Precompiler``).

Persistence: the whole map is rewritten atomically (temp file + rename) on every add/remove;
``last_used`` updates are persisted with the next rewrite (or ``save()``). One writer per file:
two processes sharing a registry file overwrite each other's additions.
Cost: a rewrite is O(total token ids) (token ids are stored to rebuild keys).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvtransport.store import ChunkKey

log = logging.getLogger(__name__)

FORMAT = 1
Ident = tuple[str, str, str]   # (tenant, kind, name)


@dataclass(frozen=True)
class RegistryEntry:
    name: str             # caller's name for the chunk, e.g. "refund-policy"
    kind: str             # "skill" | "memory"
    tenant: str           # tenant name (the key carries only its salt)
    key: ChunkKey         # where the KV lives in the tier
    text_sha256: str      # hash of the registered text (what "same content" means)
    nbytes: int           # KV bytes of the chunk
    created_at: float     # unix seconds
    last_used: float      # unix seconds; LRU order
    pinned: bool = False  # exempt from capacity eviction

    @property
    def ident(self) -> Ident:
        return (self.tenant, self.kind, self.name)

    def to_json(self) -> dict:
        d = asdict(self)
        d["key"] = {**{k: v for k, v in asdict(self.key).items() if k != "token_ids"},
                    "token_ids": list(self.key.token_ids)}
        return d

    @staticmethod
    def from_json(d: dict) -> "RegistryEntry":
        k = dict(d["key"])
        k["token_ids"] = tuple(int(t) for t in k["token_ids"])
        return RegistryEntry(**{**d, "key": ChunkKey(**k)})


class ChunkRegistry:
    """LRU-ordered map of entries. Not thread-safe: the Precompiler's lock serialises use."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._entries: dict[Ident, RegistryEntry] = {}
        if self.path is not None and self.path.exists():
            self._load()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ident: Ident) -> RegistryEntry | None:
        return self._entries.get(ident)

    def entries(self) -> list[RegistryEntry]:
        return list(self._entries.values())

    def add(self, entry: RegistryEntry) -> None:
        """Insert or replace ``entry`` and persist."""
        self._entries[entry.ident] = entry
        self.save()

    def remove(self, ident: Ident) -> RegistryEntry | None:
        """Drop ``ident`` and persist; returns the removed entry."""
        entry = self._entries.pop(ident, None)
        if entry is not None:
            self.save()
        return entry

    def update(self, ident: Ident, **changes) -> RegistryEntry:
        """Replace fields of an entry in memory only (e.g. ``last_used``, ``pinned``)."""
        self._entries[ident] = replace(self._entries[ident], **changes)
        return self._entries[ident]

    def lru(self) -> list[RegistryEntry]:
        """Entries, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    def referenced(self, key: ChunkKey) -> bool:
        """True if some entry's KV lives under ``key`` (names can share content)."""
        return any(e.key == key for e in self._entries.values())

    def used_bytes(self) -> int:
        """KV bytes of the distinct keys referenced (shared content counted once)."""
        return sum({e.key: e.nbytes for e in self._entries.values()}.values())

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "entries": [e.to_json() for e in self._entries.values()]}))
        os.replace(tmp, self.path)

    def _load(self) -> None:
        data = json.loads(self.path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"registry {self.path} has format {data.get('format')!r}, expected {FORMAT}")
        for d in data["entries"]:
            e = RegistryEntry.from_json(d)
            self._entries[e.ident] = e
