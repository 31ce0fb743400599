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

Bounded: one compile per prompt key at a time, at most ``store_behind_in_flight`` compiling and
``store_behind_queue`` waiting per router replica, first in, first out. The queue is shared by every
tenant and every prompt of the replica, so two rules keep one tenant's traffic from filling it:

- Superseded: a new store of a prompt that extends (has as a prefix) a store of the same tenant,
  salt and prefill worker still *waiting* (not compiling yet) drops the waiting one: the newer
  store covers every whole piece of it (continuing from the longest held exact prefix, as above).
  So a growing conversation, one store per turn, holds one waiting slot, not the whole queue (what
  is lost: the older prompt's exact length in the prompt index; its block boundaries come with the
  newer one). A store already compiling (or deferring to requests, ``YieldingBackends``) is kept.
- When the queue is full (``StoreBehindConfig.when_full``): ``displace`` (the default) gives a tenant
  holding fewer waiting stores than another by two or more that tenant's oldest waiting slot
  (shares even out, the queue stays full; ties: the tenant whose oldest store waited longest);
  ``skip``: the new store is skipped. Anything else: skipped (``skipped_busy``).

Every outcome is counted in ``kvnotes_prompt_stores_total{outcome}``: ``stored`` (compiled from
position 0), ``stored_delta`` (only the part past a held prefix), ``cached`` (the tier held it
already), ``skipped_held`` (the tier already holds every whole piece of it: a last, partial piece
is never kept), ``skipped_approximate`` (KV of a composed recipe cannot be rebuilt from tokens
alone), ``skipped_busy``, ``skipped_duplicate``, ``skipped_off`` (``store_behind: false``),
``superseded``, ``displaced`` (a waiting store dropped by the rules above), ``failed`` (also a
compile cancelled with its event loop); and ``scheduled`` when a compile is queued (each ends later
as exactly one of ``ENDS``: ``stored``, ``stored_delta``, ``cached``, ``superseded``, ``displaced``,
``failed``; ``scheduled`` minus those is the stores still queued or compiling, :func:`pending`, so a
client can tell that its own prompt's store has landed, not an earlier one).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cluster.control.prompt_index import PROMPT_BLOCK
from kvruntime.messages.plan import KVRef

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.decode_held import DecodeHeld
    from cluster.control.lifecycle import Finished
    from cluster.control.metrics import Metrics
    from cluster.control.prompt_index import PromptIndex

log = logging.getLogger(__name__)
ENDS = ("stored", "stored_delta", "cached", "superseded", "displaced", "failed")   # how a scheduled store
                                                                                  # ends (each exactly once)
OUTCOMES = ("scheduled", "stored", "stored_delta", "cached", "skipped_held", "skipped_approximate", "skipped_busy",
            "skipped_duplicate", "skipped_off", "superseded", "displaced", "failed")
WHEN_FULL = ("displace", "skip")


def pending(outcomes: dict[str, float]) -> float:
    """Stores queued or compiling, from ``kvnotes_prompt_stores_total`` by outcome (one replica's)."""
    return outcomes.get("scheduled", 0) - sum(outcomes.get(o, 0) for o in ENDS)


@dataclass(frozen=True)
class StoreBehindConfig:
    """``store_behind*`` in the policy section (kvruntime.config.policy.PolicyConfig)."""
    enabled: bool = True
    in_flight: int = 1                  # compiles at once per router replica
    queue: int = 4                      # stores waiting beyond those (all tenants)
    when_full: Literal["displace", "skip"] = "displace"   # a full queue: even the tenants' shares, or skip

    def __post_init__(self):
        if self.in_flight < 1 or self.queue < 0:
            raise ValueError("store behind: in_flight >= 1 and queue >= 0")
        if self.when_full not in WHEN_FULL:
            raise ValueError(f"store behind: when_full must be one of {', '.join(WHEN_FULL)}, got {self.when_full!r}")


@dataclass(frozen=True)
class StoreJob:
    """One store behind, queued or compiling."""
    tenant: str
    ref: KVRef                          # the plain prompt's exact prefix, position 0
    index: int                          # the prefill worker whose tier it goes to

    def covers(self, other: "StoreJob") -> bool:
        """Whether this store's KV holds every whole piece of ``other``'s: the same tenant, salt
        and worker, and ``other``'s tokens a proper prefix of these."""
        n = len(other.ref.token_ids)
        return (self.tenant == other.tenant and self.index == other.index and n < len(self.ref.token_ids)
                and (self.ref.tenant_salt, self.ref.position, self.ref.approx, self.ref.prefix)
                == (other.ref.tenant_salt, other.ref.position, other.ref.approx, other.ref.prefix)
                and self.ref.token_ids[:n] == other.ref.token_ids)


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
        self._waiting: list[StoreJob] = []          # queued, oldest first (started by _start, not polled)
        self._running = 0                           # compiles under way (not a Semaphore: tests run many loops)
        self._started: set[str] = set()             # digests compiling or recording
        self._tasks: set[asyncio.Task] = set()
        for o in OUTCOMES:
            metrics.prompt_stores.labels(o)          # zeros: a first skip is an increase rate() sees
        metrics.fallbacks.labels("store_behind_base_evicted")

    def schedule(self, tenant: str, ref: KVRef, hit: int, index: int) -> str:
        """Compile ``ref`` (a plain prompt's prefix, position 0) into the tier in the background;
        ``hit``: the exact prefix the tier held for it when planned. The outcome so far (the
        compile's own is counted when it ends): ``scheduled`` or why not. May drop waiting stores
        (``superseded``, ``displaced``: the module docstring)."""
        why = self._skip(ref, hit)
        job = StoreJob(tenant, ref, index)
        if not why:
            self._supersede(job)
            if len(self._started) + len(self._waiting) >= self.cfg.in_flight + self.cfg.queue \
                    and not self._displace_for(job):
                why = "skipped_busy"
        if why:
            self.metrics.prompt_stores.labels(why).inc()
            return why
        self._waiting.append(job)
        self.metrics.prompt_stores.labels("scheduled").inc()
        self._start()
        return "scheduled"

    def _skip(self, ref: KVRef, hit: int) -> str:
        if not self.cfg.enabled:
            return "skipped_off"
        if not ref.exact:
            return "skipped_approximate"
        if len(ref.token_ids) // PROMPT_BLOCK * PROMPT_BLOCK <= hit:
            return "skipped_held"
        if ref.digest in self._started or any(w.ref.digest == ref.digest for w in self._waiting):
            return "skipped_duplicate"
        return ""

    def _supersede(self, job: StoreJob) -> None:
        """Drop every waiting store ``job`` covers (it is compiled with them)."""
        gone = [w for w in self._waiting if job.covers(w)]
        for w in gone:
            self._drop(w, "superseded")
        if gone:
            log.info("store behind: %d waiting store(s) of tenant %s superseded by its %d-token prompt extending "
                     "them", len(gone), job.tenant, len(job.ref.token_ids))

    def _displace_for(self, job: StoreJob) -> bool:
        """A full queue (``when_full="displace"``): whether ``job``'s tenant holds at least two
        waiting stores fewer than the tenant holding the most; if so that tenant's oldest waiting
        store is dropped (``displaced``) to make room."""
        if self.cfg.when_full != "displace" or not self._waiting:
            return False
        held = Counter(w.tenant for w in self._waiting)
        top = max(held, key=lambda t: held[t])          # ties: the first counted, i.e. the longest waiting
        if held[top] < held[job.tenant] + 2:
            return False
        oldest = next(w for w in self._waiting if w.tenant == top)
        self._drop(oldest, "displaced")
        log.info("store behind queue full: tenant %s's oldest waiting store (%d tokens; it has %d waiting) "
                 "gives way to tenant %s's (%d waiting)", top, len(oldest.ref.token_ids), held[top], job.tenant,
                 held[job.tenant])
        return True

    def _drop(self, job: StoreJob, outcome: str) -> None:
        self._waiting.remove(job)
        self.metrics.prompt_stores.labels(outcome).inc()

    def _start(self) -> None:
        """Start waiting stores, oldest first, while a compile slot is free (in the running loop)."""
        while self._waiting and self._running < self.cfg.in_flight:
            job = self._waiting.pop(0)
            self._running += 1
            self._started.add(job.ref.digest)
            task = asyncio.get_running_loop().create_task(self._store(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _store(self, job: StoreJob) -> None:
        tenant, ref, index = job.tenant, job.ref, job.index
        compiling, cancelled = True, False
        try:
            base = await self.base(tenant, ref, index)
            info = await (self.backends.precompile(ref, index) if base is None
                          else self.backends.precompile(ref, index, base=base))
            compiling = False
            self._release()                         # the next waiting store compiles while this one is recorded
            await asyncio.to_thread(self.index.record, tenant, ref.token_ids)
        except asyncio.CancelledError:              # its event loop is closing: it did not land
            cancelled = True
            self.metrics.prompt_stores.labels("failed").inc()
            raise
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
            self._started.discard(ref.digest)
            if compiling:
                self._running -= 1
            if not cancelled:                       # no new task on a closing loop (drain starts it later)
                self._start()

    def _release(self) -> None:
        self._running -= 1
        self._start()

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
        """Wait for every scheduled store (tests, shutdown); one left waiting by a closed event
        loop starts in this one."""
        while True:
            self._start()
            if not self._tasks:
                return
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
