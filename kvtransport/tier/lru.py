"""What the ``lm://`` tier server holds: LMCache pieces in memory, least recently used evicted
beyond a capacity in bytes, and the server's Prometheus series.

:class:`LRUPieceStore` implements LMCache 0.5.6's server storage interface (``put``, ``get``,
``contains``, ``remove``, ``list_keys``, ``close``; LMCache's own ``LMSLocalBackend`` never
evicts). A ``get`` or an ``EXIST`` (``contains``) marks a piece used. A piece larger than the
whole capacity is not stored (counted ``too_large``; the client's put confirmation then fails
and is counted there). One lock serialises all operations.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class LRUPieceStore:
    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[Any, Any] = OrderedDict()   # CacheEngineKey -> LMSMemoryObj, oldest first
        self._sizes: dict[Any, int] = {}                      # CacheEngineKey -> bytes held
        self.held_bytes = 0
        self.evictions = 0             # pieces dropped to make room
        self.evicted_bytes = 0
        self.refused_puts: Counter[str] = Counter()           # reason -> puts not stored
        self.lock = threading.Lock()

    # ---- LMCache's LMSBackendInterface ------------------------------------------------------
    def put(self, client_meta: Any, kv_chunk_bytes: bytearray | None) -> None:
        from lmcache.v1.server.utils import LMSMemoryObj

        if kv_chunk_bytes is None:          # the client went away mid-PUT
            return
        size = len(kv_chunk_bytes)
        with self.lock:
            if size > self.capacity_bytes:
                self.refused_puts["too_large"] += 1
                return
            self._drop(client_meta.key)
            while self._data and self.held_bytes + size > self.capacity_bytes:
                old = next(iter(self._data))
                self.evicted_bytes += self._drop(old)
                self.evictions += 1
            self._data[client_meta.key] = LMSMemoryObj(kv_chunk_bytes, client_meta.length, client_meta.fmt,
                                                       client_meta.dtype, client_meta.shape)
            self._sizes[client_meta.key] = size
            self.held_bytes += size

    def get(self, key: Any) -> Any | None:
        with self.lock:
            obj = self._data.get(key)
            if obj is not None:
                self._data.move_to_end(key)
            return obj

    def contains(self, key: Any) -> bool:
        with self.lock:
            if key in self._data:
                self._data.move_to_end(key)
                return True
            return False

    def remove(self, key: Any) -> None:
        with self.lock:
            self._drop(key)

    def list_keys(self) -> list:
        with self.lock:
            return list(self._data)

    def close(self) -> None:
        with self.lock:
            self._data.clear()
            self._sizes.clear()
            self.held_bytes = 0

    def __len__(self) -> int:
        with self.lock:
            return len(self._data)

    def _drop(self, key: Any) -> int:
        """Remove ``key`` if held (lock held by the caller); returns the bytes freed."""
        if self._data.pop(key, None) is None:
            return 0
        size = self._sizes.pop(key)
        self.held_bytes -= size
        return size


class TierServerCollector:
    """``kvnotes_tier_server_*`` series, read from the store and the server at scrape time."""

    def __init__(self, store: LRUPieceStore, connections: Counter, tls=None):
        self.store = store
        self.connections = connections   # "accepted" | "bad_proof" | "no_proof" -> count (the server's)
        self.tls = tls                   # its TLS terminator's kvtransport.tier.tls.TlsCounts, or None (plain)

    def collect(self):
        s = self.store
        with s.lock:
            held, entries, ev, evb = s.held_bytes, len(s._data), s.evictions, s.evicted_bytes
            refused_puts = dict(s.refused_puts)
        g = GaugeMetricFamily("kvnotes_tier_server_bytes", "KV bytes the lm:// tier server holds now")
        g.add_metric([], held)
        yield g
        g = GaugeMetricFamily("kvnotes_tier_server_capacity_bytes", "Its LRU capacity (bytes)")
        g.add_metric([], s.capacity_bytes)
        yield g
        g = GaugeMetricFamily("kvnotes_tier_server_entries", "LMCache pieces it holds now")
        g.add_metric([], entries)
        yield g
        c = CounterMetricFamily("kvnotes_tier_server_evictions", "Pieces evicted (least recently used) "
                                "to stay within capacity")
        c.add_metric([], ev)
        yield c
        c = CounterMetricFamily("kvnotes_tier_server_evicted_bytes", "Bytes of those pieces")
        c.add_metric([], evb)
        yield c
        c = CounterMetricFamily("kvnotes_tier_server_refused_puts", "Puts not stored, by reason",
                                labels=["reason"])
        for reason, n in sorted(refused_puts.items()):
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("kvnotes_tier_server_connections", "Connections that proved the tier key")
        c.add_metric([], self.connections["accepted"])
        yield c
        c = CounterMetricFamily("kvnotes_tier_server_refused_connections", "Connections refused before any "
                                "command: bad_proof (wrong key, or no kvnotes handshake), no_proof (nothing "
                                "in time)", labels=["reason"])
        for reason in ("bad_proof", "no_proof"):
            c.add_metric([reason], self.connections[reason])
        yield c
        if self.tls is not None:
            yield from self._tls_series()

    def _tls_series(self):
        from kvtransport.tier.tls import FAILURE_REASONS
        counts = self.tls.snapshot()
        c = CounterMetricFamily("kvnotes_tier_server_tls_connections", "TLS connections its terminator "
                                "accepted and forwarded to LMCache's server")
        c.add_metric([], counts.get("connections", 0))
        yield c
        c = CounterMetricFamily("kvnotes_tier_server_tls_handshake_failures", "TLS handshakes refused or "
                                "failed: certificate (a client certificate missing or not of the CA), "
                                "protocol (not TLS, e.g. plaintext), timeout, closed", labels=["reason"])
        for reason in FAILURE_REASONS:
            c.add_metric([reason], counts.get(f"handshake_failures:{reason}", 0))
        yield c
