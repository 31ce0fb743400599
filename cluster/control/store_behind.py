"""A plain prompt the decode engine computed itself, stored in the tier behind it.

On the vLLM decode engine a prompt that reuses nothing runs no prefill (``decode_computes_cold``),
and one whose exact prefix vLLM's own prefix cache holds is finished by vLLM
(``messages.plan.decode_computes_rest``): the first token comes as fast as in plain vLLM, but no
prefill worker built the prompt's KV, so nothing reached the tier and the prompt index, and a
later prompt equal to it but for one field could not be planned as an edit of it. So when such a
request has ended (after its last token: off its time to first token), its exact prefix
``KVRef(prefix, 0, salt)`` is compiled by a prefill worker (``Backends.precompile``, stored in the
tier like a prefill worker's ``store_as``) and, once stored, recorded in the prompt index (every
block boundary and its whole length: the index finds the whole prompt).

Only what the tier lacks is computed: just before compiling, the longest exact prefix of the
prompt the tier holds is looked up (the prompt index at its block boundaries and at the exact
length of the tenant's last exact prompt on a decode engine, :mod:`cluster.control.decode_held`:
in a growing conversation, the previous turn, stored behind it), and the prefill worker computes
only the rest, continuing from that prefix's KV (``prefill_workers.store_delta``: equal to a
compile from position 0 within the engine's float tolerance). A base the tier dropped meanwhile
is compiled from position 0, counted as ``kvnotes_fallbacks_total{reason="store_behind_base_evicted"}``.

Bounded: one compile per prompt key at a time, at most ``store_behind_in_flight`` running and
``store_behind_queue`` waiting per router replica (more: skipped). Every outcome is counted in
``kvnotes_prompt_stores_total{outcome}``: ``stored`` (compiled from position 0), ``stored_delta``
(only the part past a held prefix), ``cached`` (the tier held it already), ``skipped_held`` (the
tier already holds every whole piece of it: a last, partial piece is never kept),
``skipped_approximate`` (KV of a composed recipe cannot be rebuilt from tokens alone),
``skipped_busy``, ``skipped_duplicate``, ``skipped_off`` (``store_behind: false``), ``failed``; and
``scheduled`` when a compile is queued (each ends later as one of ``stored``, ``stored_delta``,
``cached``, ``failed``: ``scheduled`` minus those is the stores still queued or compiling,
:func:`pending`, so a client can tell that its own prompt's store has landed, not an earlier one).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.control.prompt_index import PROMPT_BLOCK
from kvruntime.messages.plan import KVRef

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.decode_held import DecodeHeld
    from cluster.control.lifecycle import Finished
    from cluster.control.metrics import Metrics
    from cluster.control.prompt_index import PromptIndex

log = logging.getLogger(__name__)
OUTCOMES = ("scheduled", "stored", "stored_delta", "cached", "skipped_held", "skipped_approximate", "skipped_busy",
            "skipped_duplicate", "skipped_off", "failed")
ENDS = ("stored", "stored_delta", "cached", "failed")   # how a scheduled store ends (counted once each)


def pending(outcomes: dict[str, float]) -> float:
    """Stores queued or compiling, from ``kvnotes_prompt_stores_total`` by outcome (one replica's)."""
    return outcomes.get("scheduled", 0) - sum(outcomes.get(o, 0) for o in ENDS)


@dataclass(frozen=True)
class StoreBehindConfig:
    """``store_behind*`` in the policy section (kvruntime.config.policy.PolicyConfig)."""
    enabled: bool = True
    in_flight: int = 1
    queue: int = 4

    def __post_init__(self):
        if self.in_flight < 1 or self.queue < 0:
            raise ValueError("store behind: in_flight >= 1 and queue >= 0")


def needs_store(store_as: KVRef | None, fin: "Finished") -> bool:
    """Whether a finished plain prompt asked to store its prefix and nobody did: no prefill ran
    (the decode engine computed it), and no store failed (a failed one is already counted as
    ``tier_store_failed``)."""
    return store_as is not None and not fin.stored and "tier_store_failed" not in fin.fallbacks


class StoreBehind:
    def __init__(self, backends: "Backends", metrics: "Metrics", index: "PromptIndex",
                 cfg: StoreBehindConfig = StoreBehindConfig(), held: "DecodeHeld | None" = None):
        self.backends, self.metrics, self.index, self.cfg = backends, metrics, index, cfg
        self.held = held                            # the decode engines' exact prompts: a base's exact length
        self._running = 0                           # compiles under way (not a Semaphore: tests run many loops)
        self._pending: set[str] = set()             # digests queued or compiling
        self._tasks: set[asyncio.Task] = set()
        for o in OUTCOMES:
            metrics.prompt_stores.labels(o)          # zeros: a first skip is an increase rate() sees
        metrics.fallbacks.labels("store_behind_base_evicted")

    def schedule(self, tenant: str, ref: KVRef, hit: int, index: int) -> str:
        """Compile ``ref`` (a plain prompt's prefix, position 0) into the tier in the background;
        ``hit``: the exact prefix the tier held for it when planned. The outcome so far (the
        compile's own is counted when it ends): ``scheduled`` or why not."""
        why = self._skip(ref, hit)
        if why:
            self.metrics.prompt_stores.labels(why).inc()
            return why
        self._pending.add(ref.digest)
        self.metrics.prompt_stores.labels("scheduled").inc()
        task = asyncio.get_running_loop().create_task(self._store(tenant, ref, index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return "scheduled"

    def _skip(self, ref: KVRef, hit: int) -> str:
        if not self.cfg.enabled:
            return "skipped_off"
        if not ref.exact:
            return "skipped_approximate"
        if len(ref.token_ids) // PROMPT_BLOCK * PROMPT_BLOCK <= hit:
            return "skipped_held"
        if ref.digest in self._pending:
            return "skipped_duplicate"
        if len(self._pending) >= self.cfg.in_flight + self.cfg.queue:
            return "skipped_busy"
        return ""

    async def _store(self, tenant: str, ref: KVRef, index: int) -> None:
        try:
            while self._running >= self.cfg.in_flight:      # queued (bounded in schedule())
                await asyncio.sleep(0.05)
            self._running += 1
            try:
                base = await self.base(tenant, ref, index)
                info = await (self.backends.precompile(ref, index) if base is None
                              else self.backends.precompile(ref, index, base=base))
            finally:
                self._running -= 1
            await asyncio.to_thread(self.index.record, tenant, ref.token_ids)
        except Exception as exc:            # the prompt was answered; it is just not reusable from the tier
            self.metrics.prompt_stores.labels("failed").inc()
            log.warning("storing a %d-token prompt the decode engine computed failed: %s", len(ref.token_ids), exc)
        else:
            if base is not None and not info.cached and not info.start:
                self.metrics.record_fallback("store_behind_base_evicted")
            self.metrics.prompt_stores.labels("cached" if info.cached else "stored_delta" if info.start
                                              else "stored").inc()
            log.info("a %d-token prompt the decode engine computed stored in the tier: %d tokens computed "
                     "after %d held (%.3f s)", len(ref.token_ids), len(ref.token_ids) - info.start, info.start,
                     info.seconds)
        finally:
            self._pending.discard(ref.digest)

    async def base(self, tenant: str, ref: KVRef, index: int) -> KVRef | None:
        """The longest exact prefix of ``ref`` shorter than it that prefill worker ``index``'s tier
        holds (None: none): the prompt index's block boundaries and, from the decode-held record,
        the exact length of an earlier exact prompt this one extends (stored behind as all of it
        but its last token, the plain prompt's suffix)."""
        n = len(ref.token_ids)
        ends = (await asyncio.to_thread(self.held.lookup, tenant, ref.token_ids)).ends if self.held is not None else ()
        extra = tuple(k for e in ends for k in (e, e - 1) if 0 < k < n)
        kv, got = await self.index.longest_held(tenant, ref.tenant_salt, ref.token_ids[:n - 1], index,
                                                extra=extra)
        return kv if kv is not None and 0 < got < n else None

    async def drain(self) -> None:
        """Wait for every scheduled store (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
