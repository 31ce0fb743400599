"""What the decode engines' own prefix caches hold exactly: one record shared by every router
replica, kept in the state store (it survives a router restart).

A plain prompt whose exact plan ran on a decode engine leaves its KV there under the tenant's
exact salt (vLLM's prefix cache, whole blocks; the reference engine's held prefixes). A growing
conversation's next turn starts with all of it. The tier may not hold it yet (its store runs
behind, :mod:`cluster.control.store_behind`), and prompt matching may find a chunk further in
(a catalogue seen in earlier turns): an approximate plan is then salted by its recipe
(``RequestPlan.kv_salt``), vLLM's exact blocks are not looked up, and the conversation reuses less
than plain vLLM would. So the router records each exact prompt a decode engine ran, and the
planner prefers the exact prefix the records give when it reuses at least as much as the
approximate plan (:func:`prefer_exact`): the longest exact prefix first, from the tier or the
decode engine's own cache. A hint, never a promise: the decode worker's ``expect`` answer says
what it holds when the request runs.

Records (``StateStore.put_decode_held`` / ``get_decode_held``, tenant-scoped):
- keyed by the **decode actor incarnation** that ran the prompt (``decode-1@<boot>``: the worker
  and the random id its process drew at start, reported in ``DecodeSummary.engine`` and in its
  health answer). vLLM's prefix cache is per engine and empty after a restart: a lookup asks only
  for the incarnations the replica's health view sees alive now, so a restarted actor's records
  are ignored from its first health answer on and age out (TTL, LRU). Backends whose workers report
  no incarnation (in process) have one, ``local``;
- one entry per :data:`DECODE_BLOCK` leading tokens, named by a hash chain over the blocks (a
  lookup hashes the prompt once, O(n), and reads every boundary in one round trip), and one
  ``end`` entry giving the noted prompt's exact length with a hash of its last, partial block;
- bounded by ``decode_held_ttl_s`` and ``decode_held_max`` (state section; LRU, all tenants).
A store that does not answer reads as nothing held and a write is skipped, counted as
``kvnotes_fallbacks_total{reason="decode_held_unavailable"}``.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cluster.control.state import StateStore, StateStoreUnavailable
from kvruntime.messages.plan import PlanKind, RequestPlan

if TYPE_CHECKING:
    from cluster.control.metrics import Metrics
    from cluster.control.routing import WorkerView

log = logging.getLogger(__name__)
DECODE_BLOCK = 64             # record granularity (tokens): finer than vLLM's blocks (16 on GPU, 128 on CPU)
LOCAL = "local"               # the one incarnation of backends whose workers report none (in process)
_TAIL_BITS = 40               # an end entry's value: length << 40 | 40 bits of the partial block's hash


@dataclass(frozen=True)
class Held:
    tokens: int = 0           # leading prompt tokens a live decode engine holds
    engine: str = ""          # which incarnation ("decode-1@<boot>", LOCAL; "" none)
    ends: tuple[int, ...] = ()  # exact lengths of noted prompts the looked-up ids start with (store-behind's bases)


def chain(tenant: str, ids) -> tuple[np.ndarray, list[bytes]]:
    """``ids`` as int64 and the hash of its first ``k * DECODE_BLOCK`` tokens for k = 0, 1, ..."""
    arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    h = hashlib.blake2b(tenant.encode(), digest_size=16).digest()
    out = [h]
    for b in range(DECODE_BLOCK, len(arr) + 1, DECODE_BLOCK):
        h = hashlib.blake2b(h + arr[b - DECODE_BLOCK:b].tobytes(), digest_size=16).digest()
        out.append(h)
    return arr, out


def _tail(h: bytes, tail: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(h + tail.tobytes(), digest_size=8).digest()[:5], "big")


class DecodeHeld:
    def __init__(self, state: StateStore, view: "WorkerView | None" = None, metrics: "Metrics | None" = None):
        self.state, self.view, self.metrics = state, view, metrics
        if metrics is not None:
            metrics.fallbacks.labels("decode_held_unavailable")     # a zero: the first one is a rate() increase

    def engines(self) -> list[str]:
        """The decode incarnations alive in this replica's health view now (LOCAL when none reports one)."""
        if self.view is None:
            return [LOCAL]
        live = [f"decode-{i}@{w.boot}" for i, w in enumerate(self.view.workers["decode"])
                if w.alive and w.boot]
        return live or ([LOCAL] if not any(w.boot for w in self.view.workers["decode"]) else [])

    def note(self, tenant: str, ids, engine: str = "") -> None:
        """An exact plan of ``ids`` (prefix and suffix) ran on decode incarnation ``engine``
        (``DecodeSummary.engine``; "": LOCAL): its KV is in that engine's cache now."""
        engine = engine or LOCAL
        arr, hs = chain(tenant, ids)
        blocks = {f"{engine}|{h.hex()}": k * DECODE_BLOCK for k, h in enumerate(hs) if k}
        last = len(hs) - 1
        blocks[f"{engine}|{hs[last].hex()}|end"] = len(arr) << _TAIL_BITS | _tail(hs[last], arr[last * DECODE_BLOCK:])
        try:
            self.state.put_decode_held(tenant, blocks, time.time())
        except StateStoreUnavailable as exc:      # the answer stands, the hint is lost
            self._unavailable(exc)

    def lookup(self, tenant: str, ids) -> Held:
        """The longest leading run of ``ids`` a live decode engine holds, by the shared records."""
        engines = self.engines()
        if not engines:
            return Held()
        arr, hs = chain(tenant, ids)
        keys = [f"{e}|{h.hex()}{end}" for e in engines for h in hs for end in ("", "|end")]
        try:
            got = self.state.get_decode_held(tenant, keys, time.time())
        except StateStoreUnavailable as exc:
            self._unavailable(exc)
            return Held()
        best, ends = Held(), set()
        for e in engines:
            for k, h in enumerate(hs):
                n = k * DECODE_BLOCK
                if k and f"{e}|{h.hex()}" not in got:
                    break                                     # the chain: nothing past a missing block
                if n > best.tokens:
                    best = Held(n, e)
                v = got.get(f"{e}|{h.hex()}|end")
                p = -1 if v is None else v >> _TAIL_BITS
                if n <= p <= len(arr) and _tail(h, arr[n:p]) == v & ((1 << _TAIL_BITS) - 1):
                    ends.add(p)
                    if p > best.tokens:
                        best = Held(p, e)
        return Held(best.tokens, best.engine, tuple(sorted(ends)))

    def longest(self, tenant: str, ids) -> int:
        """Leading tokens of ``ids`` a live decode engine holds (one of the tenant's exact prompts)."""
        return self.lookup(tenant, ids).tokens

    def _unavailable(self, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.record_fallback("decode_held_unavailable")
        log.warning("decode-held record skipped (planned without it): %s", exc)


def sourced(plan: RequestPlan) -> int:
    """Prefix tokens ``plan`` takes from KV rather than computing in context: its reuse,
    reposition and edit steps whole (a span compiled in this request's build counts: the plan
    makes it reusable)."""
    return sum(s.tokens for s in plan.steps if s.kind not in (PlanKind.RECOMPUTE, PlanKind.ERRATUM))


def prefer_exact(plan: RequestPlan, held: int, hit: int) -> bool:
    """Whether an approximate ``plan`` gives way to the exact prefix of ``held`` tokens the decode
    engine holds (``hit``: the exact prefix the tier holds, already in the plan): when that prefix
    is longer than the tier's and covers at least as many tokens as the plan takes from KV."""
    return bool(plan.approx) and held > hit and held >= sourced(plan)
