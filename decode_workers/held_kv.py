"""Prefix KV the reference decode engine keeps after a request, so the next request that starts
with the same tokens under the same salt is not sent it again (nothing crosses the wire twice).

Entries are keyed by (salt, token ids): the router passes ``RequestPlan.kv_salt``, which folds
in the tenant, the model and the plan's recipe (exact or which approximation), so different
tenants' or recipes' KV never match. A lookup returns the longest common leading run of token
ids with any entry of that salt (KV of slot i depends on slots <= i only). Bounded by bytes
(``decode_prefix_cache_bytes``), least recently used evicted first; every eviction is counted
(``kvnotes_decode_prefix_evictions_total``) and logged. ``hold`` pins the held slice for one
announced transfer, so an eviction between ``DecodeWorker.expect`` and ``generate`` cannot take
it away; pins are few (``max_pins``, oldest dropped: that request then recomputes, counted).

:meth:`HeldPrefixes.put_copy` keeps a fresh copy of KV that aliases reused memory (a received
block's pool lease) in a background thread, so the copy is off the first token's path (it cost TTFT):
the source stays alive until the copy is done, the entry appears only once it is whole (never a
half-written copy), and a lookup of that salt meanwhile waits for it (at most ``copy_wait_s``;
past that it sees what is already held, counted in ``copy_wait_timeouts`` and logged).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvruntime.kv import KVCache
from kvruntime.messages.plan import decode_computes_rest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldStats:
    held_bytes: int
    entries: int
    evictions: int
    hit_tokens: int          # prefix tokens not sent because this cache held them
    pins_dropped: int
    copy_waits: int = 0          # lookups that waited for a background copy of their salt
    copy_wait_timeouts: int = 0  # ... and gave up after ``copy_wait_s`` (saw what was held already)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class HeldPrefixes:
    """Thread-safe byte-bounded LRU of prefix KV (CPU or the engine's device, engine dtype)."""

    def __init__(self, capacity_bytes: int, *, max_pins: int = 64, copy_wait_s: float = 30.0):
        if capacity_bytes < 0 or max_pins < 1 or copy_wait_s < 0:
            raise ValueError("capacity_bytes must be >= 0, max_pins >= 1 and copy_wait_s >= 0")
        self.capacity, self.max_pins, self.copy_wait_s = capacity_bytes, max_pins, copy_wait_s
        self._entries: OrderedDict[tuple[str, bytes], tuple[np.ndarray, KVCache]] = OrderedDict()
        self._pins: OrderedDict[str, KVCache] = OrderedDict()
        self._lock = threading.Lock()
        self._copied = threading.Condition(self._lock)      # notified when a background copy lands
        self._copying: dict[str, int] = {}                  # salt -> background copies under way
        self._bytes = self._evictions = self._hit_tokens = self._pins_dropped = 0
        self._copy_waits = self._copy_wait_timeouts = 0

    def _await_copies(self, salt: str) -> None:
        """With the lock held: wait (bounded) until no background copy of ``salt`` is under way."""
        if not self._copying.get(salt):
            return
        self._copy_waits += 1
        if not self._copied.wait_for(lambda: not self._copying.get(salt), timeout=self.copy_wait_s):
            self._copy_wait_timeouts += 1
            log.warning("held prefix copy for salt %s not done after %.1f s: lookup sees what is held",
                        salt, self.copy_wait_s)

    def _longest(self, prefix_ids, salt: str) -> tuple[int, tuple | None]:
        ids = np.asarray(prefix_ids, dtype=np.int64)
        best, key = 0, None
        for k, (toks, _) in self._entries.items():
            if k[0] == salt:
                n = _common(toks, ids)
                if n > best:
                    best, key = n, k
        return best, key

    def held_prefix(self, prefix_ids, salt: str | None) -> int:
        """How many leading tokens of ``prefix_ids`` this cache holds under ``salt`` (a lookup)."""
        if not prefix_ids or salt is None:
            return 0
        with self._lock:
            self._await_copies(salt)
            return self._longest(prefix_ids, salt)[0]

    def hold(self, transfer_id: str, prefix_ids, salt: str | None, limit: int,
             computes_from: int | None = None) -> int:
        """Pin the held KV of at most ``limit`` leading tokens for ``transfer_id`` (taken back
        with :meth:`take`); returns the pinned token count (0: nothing held, nothing pinned).
        When what is held reaches ``computes_from`` (``messages.plan.decode_computes_rest``: this
        engine computes the rest of the prefix itself), everything held is pinned, up to the
        whole prefix, whatever ``limit``."""
        if not prefix_ids or salt is None:
            return 0
        with self._lock:
            self._await_copies(salt)
            n, key = self._longest(prefix_ids, salt)
            n = n if decode_computes_rest(n, computes_from) else min(n, limit)
            if not n:
                return 0
            self._entries.move_to_end(key)
            self._pins[transfer_id] = self._entries[key][1].slice(0, n)
            while len(self._pins) > self.max_pins:
                tid, _ = self._pins.popitem(last=False)
                self._pins_dropped += 1
                log.warning("held prefix pin of transfer %s dropped (more than %d pins)", tid, self.max_pins)
            self._hit_tokens += n
            return n

    def take(self, transfer_id: str) -> KVCache | None:
        with self._lock:
            return self._pins.pop(transfer_id, None)

    def put(self, prefix_ids, salt: str | None, kv: KVCache) -> bool:
        """Keep ``kv`` (must not alias memory someone else reuses: pass a fresh tensor) as the KV
        of ``prefix_ids`` under ``salt``. Entries it extends are replaced; LRU entries are
        evicted (counted, logged) until the budget holds. False if it does not fit at all."""
        size = kv.nbytes
        if salt is None or not prefix_ids or size > self.capacity:
            return False
        ids = np.asarray(prefix_ids, dtype=np.int64)
        key = (salt, ids.tobytes())
        with self._lock:
            for k, (toks, old) in list(self._entries.items()):
                if k[0] != salt or len(toks) > len(ids):
                    if k[0] == salt and _common(toks, ids) == len(ids):
                        self._entries.move_to_end(k)          # a longer entry already covers it
                        return True
                    continue
                if _common(toks, ids) == len(toks):           # the new entry extends (or equals) this one
                    del self._entries[k]
                    self._bytes -= old.nbytes
            self._entries[key] = (ids, kv)
            self._bytes += size
            while self._bytes > self.capacity:
                k, (toks, old) = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self._evictions += 1
                log.info("held prefix KV evicted: %d tokens, %d bytes (decode_prefix_cache_bytes %d)",
                         len(toks), old.nbytes, self.capacity)
            return True

    def put_copy(self, prefix_ids, salt: str | None, kv: KVCache) -> "HeldCopy | None":
        """:meth:`put` a fresh copy of ``kv`` (which may alias reused memory: it is kept alive
        until copied), made in a background thread; None when nothing is to be kept."""
        if salt is None or not prefix_ids or kv.nbytes > self.capacity:
            return None
        with self._lock:
            self._copying[salt] = self._copying.get(salt, 0) + 1
        return HeldCopy(self, tuple(prefix_ids), salt, kv)

    def _copy_done(self, salt: str) -> None:
        with self._lock:
            self._copying[salt] -= 1
            if not self._copying[salt]:
                del self._copying[salt]
            self._copied.notify_all()

    def stats(self) -> HeldStats:
        with self._lock:
            return HeldStats(self._bytes, len(self._entries), self._evictions, self._hit_tokens, self._pins_dropped,
                             self._copy_waits, self._copy_wait_timeouts)


class HeldCopy:
    """One background copy into a :class:`HeldPrefixes` (see :meth:`HeldPrefixes.put_copy`):
    ``wait`` joins it; ``seconds`` is what the copy and its put took (the ``held_copy`` stage)."""

    def __init__(self, held: HeldPrefixes, prefix_ids: tuple, salt: str, kv: KVCache):
        self.seconds = 0.0
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(held, prefix_ids, salt, kv), name="held-prefix-copy",
                         daemon=True).start()

    def _run(self, held: HeldPrefixes, prefix_ids: tuple, salt: str, kv: KVCache) -> None:
        t = time.perf_counter()
        try:
            held.put(prefix_ids, salt, KVCache(kv.data.clone(), kv.positions, kv.token_ids))
        except Exception:                       # out of memory, ...: nothing kept, the next request is sent it
            log.exception("held prefix copy of %d tokens failed; not kept", len(prefix_ids))
        finally:
            self.seconds = time.perf_counter() - t
            held._copy_done(salt)
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
