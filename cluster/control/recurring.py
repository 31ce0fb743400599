"""Recurring spans, compiled once on their own: what a prompt leaves behind for the next one.

Sighting by sighting, for a span of a tenant's plain prompts:
1. **first sighting** (a prompt holding it answered; after its first token, off the time to
   first token): the prompt's ids are kept (``StateStore.put_held_prompt``, bounded LRU) and each
   of its content-defined spans is counted once and remembered as last seen in this prompt, at
   its offset (the span entry's data, :mod:`cluster.control.fingerprints`); a repeat of a prompt
   already kept counts nothing (a span recurs across prompts, not across retries). Nothing is
   reused: the first prompt's KV of it was computed inside that prompt's context. Under
   ``compile_after`` 1 (the default) the prompt's document-like units (:mod:`cluster.control.units`)
   not already held are compiled on their own in the background now, where the request's policy
   splices chunks (``outcome="unit_first_sighting"``, then ``compiled`` / ``cached``): a document
   re-sent in another order is reused from its second sighting. Not for a prompt that starts with
   a whole earlier kept prompt (:func:`extended`: a growing conversation's turn), whose next turn
   reaches its content through the prefix (``outcome="units_skipped_extends"``). The steps below
   are then those of text recurring otherwise (a run two prompts share that is no unit of the first).
2. **second sighting** (:meth:`RecurringSpans.sighted`, on the request path, from the entries
   the one batched match read returned): the span is grown to the whole run of tokens the two
   prompts share around it (:func:`grow`: e.g. the whole document, whatever surrounds it in each),
   cut back to line breaks (:func:`trim`), and planned as a chunk the tier does not hold yet: the
   planner's re-warm rule compiles it on its own as part of *this* request's build (in its frame,
   after BOS, at its canonical position, the way a registration is precompiled), stores it in the
   tier and splices it (reposition + seam / selective recompute by the policy's row). Its tokens
   count as computed, not reused (``kvnotes_reused_tokens_total`` is unchanged by it); its anchors
   are stored when the answer ends (``outcome="compiled_in_request"``). Composition so only ever
   splices KV of the kind the fidelity profile measured, never KV computed inside another
   prompt's context. Where the policy recomputes the span instead (``exact``, or no row allows
   it), or the span is all the prompt would reuse and the decode engine computes cold prompts
   itself (vLLM: the planner keeps such a prompt exact, ``planner._reuses_nothing``), it is compiled
   in the background after the answer (off the request, ``outcome="compiled"`` / ``"cached"``).
3. **third sighting on**: matched at any offset by its anchors (:mod:`cluster.control.matching`)
   and reused from the tier.
A run the tier has evicted is dropped from the anchors when a prompt next matches it
(``kvnotes_reuse_miss_total{reason="span_evicted"}``) and is compiled again if it recurs again.

A background compile (a unit's or a run's) goes through the router's one background gate,
:class:`cluster.control.backends.YieldingBackends` (the gate store-behind uses, one
``RequestActivity`` and ``policy.background_quiet_s`` / ``background_max_wait_s`` for both): it
waits until no request of this replica has been in flight for ``quiet_s``, at most ``max_wait_s``
(counted in ``kvnotes_fallbacks_total{reason="background_deferred"|
"background_deferral_expired"}``). A prefill actor runs one call at a time, in order: a compile sent
beside a request would run ahead of that request's next build. At most
``matching.compiles_in_flight`` compiles hold a slot per replica, one waiting in the gate included;
more wait in a first-in-first-out queue of at most ``matching.compile_queue``, each handed the slot
of the compile that frees one (not polled): a burst of first-sighting documents is compiled in
order, not dropped. Compiles in a request's build or a registration's core never wait.

Each outcome is counted in ``kvnotes_recurring_spans_total{outcome}`` (every one exported as 0 from
the start): ``scheduled`` for each background compile asked for, then exactly one of :data:`ENDS`
(``compiled``; ``cached``: the tier held it, or the same run was queued or compiling already;
``failed``: also one cancelled with its event loop, queued or not; ``skipped_busy``: every slot
taken and the queue full; ``no_anchor``); :func:`pending` (``scheduled`` minus those) is the
compiles still queued, waiting or running, so a client can wait for its own prompt's compiles, not
an earlier one's. Not ends: ``compiled_in_request``, ``unit_first_sighting`` (units scheduled: each
is also ``scheduled``), ``units_skipped_extends``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.control.fingerprints import Cut, fingerprint
from cluster.control.matching import (ChunkMatch, MatchConfig, add_anchors, anchor_entries, drop_anchors, last_seen,
                                      nearest_held)
from cluster.control.state import StateStore, StateStoreUnavailable
from cluster.control.units import units
from kvruntime.messages.plan import KVRef, PlanKind, RequestPlan

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.metrics import Metrics

log = logging.getLogger(__name__)
ENDS = ("compiled", "cached", "failed", "skipped_busy", "no_anchor")    # how a scheduled compile ends (once)
OUTCOMES = ("scheduled",) + ENDS + ("compiled_in_request", "unit_first_sighting", "units_skipped_extends")


def pending(outcomes: dict[str, float]) -> float:
    """Background compiles queued, waiting or running, from ``kvnotes_recurring_spans_total`` by
    outcome (one replica's)."""
    return outcomes.get("scheduled", 0) - sum(outcomes.get(o, 0) for o in ENDS)


def grow(new: tuple[int, ...], at: int, old: tuple[int, ...], old_at: int, n: int) -> tuple[int, int, int]:
    """The run both sequences share around ``new[at:at+n] == old[old_at:old_at+n]``:
    ``(start in new, start in old, length)``, grown left and right while the ids agree."""
    a, b = at, old_at
    while a > 0 and b > 0 and new[a - 1] == old[b - 1]:
        a, b = a - 1, b - 1
    end, old_end = at + n, old_at + n
    while end < len(new) and old_end < len(old) and new[end] == old[old_end]:
        end, old_end = end + 1, old_end + 1
    return a, b, end - a


def trim(ids: tuple[int, ...], start: int, end: int, is_break, window: int) -> tuple[int, int]:
    """A grown run cut back to line breaks near its edges. An edge not at a line's start / end
    moves in to just after the nearest token holding a line break within ``window`` tokens: two
    prompts' shared edges are often a coincidence (a separator, the same last words of two
    documents) that a third prompt does not share, while documents, tool outputs and catalogue
    entries start and end at line breaks. No break near an edge: that edge stays."""
    if is_break is None:
        return start, end
    head = start
    if start > 0 and not is_break(ids[start - 1]):
        head = next((i + 1 for i in range(start, min(start + window, end)) if is_break(ids[i])), start)
    tail = end
    if not is_break(ids[end - 1]):
        tail = next((i + 1 for i in range(end - 1, max(end - window, head) - 1, -1) if is_break(ids[i])), end)
    return (head, tail) if tail > head else (start, end)


def recurring_runs(ids: tuple[int, ...], c: Cut, counts: dict[str, int], seen: dict, earlier, cfg: MatchConfig,
                   covered: list[tuple[int, int]], is_break=None) -> list[tuple[int, int]]:
    """The runs (start, end) of ``ids`` to compile: each grown from a span counted in
    ``span_after`` prompts against the earlier prompt it was seen in (``earlier(key)``: its
    ids, or None when no longer kept: the span alone, then) and cut back to line breaks near its
    edges (:func:`trim`), outside ``covered``; a run both prompts open with is skipped (the
    prompt index serves a shared prefix exactly)."""
    runs: list[tuple[int, int]] = list(covered)
    out = []
    for s in c.spans:
        if counts.get(s.key, 0) < cfg.span_after or any(a < s.end and s.start < b for a, b in runs):
            continue
        where = last_seen(seen, s.key)
        old = earlier(where[0]) if where else None
        if old is not None and tuple(old[where[1]:where[1] + s.tokens]) == tuple(ids[s.start:s.end]):
            start, old_start, n = grow(ids, s.start, old, where[1], s.tokens)
        else:
            start, old_start, n = s.start, -1, s.tokens
        if start == 0 and old_start == 0:
            continue
        start, end = clip(start, start + n, s.start, s.end, runs)
        run = trim(ids, start, end, is_break, cfg.trim_window) if old_start >= 0 else (start, end)
        runs.append(run)
        if run[1] - run[0] >= cfg.min_chunk_tokens:
            out.append(run)
    return out


def clip(start: int, end: int, seed_start: int, seed_end: int, taken: list[tuple[int, int]]) -> tuple[int, int]:
    """A run grown around its seed span ``[seed_start, seed_end)`` stopped at the edges of the
    ``taken`` runs (chunks this prompt already matched, runs already chosen): two documents that
    happened to follow each other in two prompts stay two chunks when one of them is held, so the
    held one is reused and only the other compiled."""
    for a, b in taken:
        if seed_end <= a < end:
            end = a
        if start < b <= seed_start:
            start = b
    return start, end


@dataclass(eq=False)
class _Job:
    """One scheduled background compile (mutable bookkeeping): queued, then compiling."""
    tenant: str
    ref: KVRef
    index: int
    entries: dict[str, str]
    turn: "asyncio.Future | None" = None    # a queued one's: done when a slot is handed to it
    holds: bool = False                     # holds a compile slot
    ended: bool = False                     # its one end counted


class RecurringSpans:
    """Counts a tenant's spans, finds the ones a prompt's sighting makes recurring (compiled in its
    build) and compiles in the background those its policy recomputed."""

    def __init__(self, state: StateStore, backends: "Backends", metrics: "Metrics", cfg: MatchConfig,
                 chunk_position: int, is_break=None, text=None, background: "Backends | None" = None):
        """``is_break(token_id)``: the token's text holds a line break (None: runs are not trimmed);
        ``text(token_id)``: its text (None: no document-like units, :mod:`cluster.control.units`);
        ``background``: the backends background compiles go through (the router's
        :class:`~cluster.control.backends.YieldingBackends`; None: ``backends``, no gate)."""
        self.state, self.backends, self.metrics, self.cfg = state, backends, metrics, cfg
        self.background = background if background is not None else backends
        self.chunk_position, self.is_break, self.text = chunk_position, is_break, text
        self.in_flight = 0                          # compiles holding a slot (in the gate or compiling)
        self._queue: deque[_Job] = deque()          # waiting for a slot, oldest first (handed one, not polled)
        self._digests: set[str] = set()             # runs queued or compiling (a duplicate is not queued)
        self._tasks: set[asyncio.Task] = set()
        for o in OUTCOMES:
            metrics.recurring_spans.labels(o)       # zeros: pending() reads 0, a first skip is an increase

    def sighted(self, tenant: str, salt: str, key: str, ids: tuple[int, ...], c: Cut, seen: dict, hit: int,
                covered: list[tuple[int, int]]) -> list[ChunkMatch]:
        """The runs of this prompt (``key``) that this very sighting makes recurring (a span kept
        prompts held ``span_after - 1`` times or more, last seen in another prompt, outside the
        exact prefix of ``hit`` tokens and the ``covered`` chunks), as span chunks to plan: the
        tier does not hold them yet, so the planner compiles each on its own in this request's
        build (the re-warm rule) and splices it. Reads the earlier prompts back (one read each);
        a run without an anchor is left out (no later prompt could find it)."""
        counts = {}
        for s in c.spans:
            got, where = seen.get(s.key), last_seen(seen, s.key)
            if got is not None and where is not None and where[0] != key and got[0] + 1 >= self.cfg.span_after:
                counts[s.key] = got[0] + 1
        if not counts:
            return []
        now, kept = time.time(), {}

        def earlier(k):
            if k not in kept:
                kept[k] = self.state.get_held_prompt(tenant, k, now, touch=False)    # touched when recorded
            return kept[k]
        out = []
        for start, end in recurring_runs(ids, c, counts, seen, earlier, self.cfg, covered + [(0, hit)] * bool(hit),
                                         self.is_break):
            run = tuple(ids[start:end])
            if end - start >= self.cfg.min_chunk_tokens and anchor_entries("span", "", tenant, run, self.cfg.spans):
                out.append(ChunkMatch(start, end, "span", fingerprint(tenant, run)[:12],
                                      KVRef(run, self.chunk_position, salt)))
        return out

    async def observe(self, tenant: str, salt: str, key: str, ids: tuple[int, ...], c: Cut, seen: dict,
                      matched: list[ChunkMatch], index: int, compile: bool = True, held: bool = False,
                      fresh: frozenset[str] = frozenset(), plan: RequestPlan | None = None,
                      fallbacks: tuple[str, ...] = (), units_at: list[tuple[int, int]] | None = None) -> None:
        """Record one answered prompt (``seen``: the entries its match read), in a worker thread,
        before its last event goes out (so the client's next prompt finds it), then schedule the
        compiles of its recurring runs in the background. ``compile``: False to count its spans
        without compiling any; ``held``: its exact KV is now in the tier, so its spans point at it
        from now on, for finding edits of it; the spans of a prompt not held point at it only where
        they pointed nowhere. ``fresh``: digests of the matched spans :meth:`sighted` found: the
        ones ``plan`` spliced were compiled in the request's build (their anchors are stored now),
        the others are left to the background compile. ``units_at``: content ranges whose
        document-like units a first sighting compiles (``compile_after`` 1, where the request's
        policy splices chunks; None: none)."""
        inline = _compiled_in_request(matched, fresh, plan, fallbacks)
        covered = [m for m in matched if m.kv.digest not in fresh or m in inline]
        try:
            runs = await asyncio.to_thread(self._record, tenant, key, ids, c, seen, covered, held, inline, units_at)
        except StateStoreUnavailable as exc:        # a cache: this prompt just teaches nothing
            self.metrics.reuse_misses.labels("store_unavailable").inc()
            log.warning("recording the prompt's spans skipped: %s", exc)
            return
        if inline:
            self.metrics.recurring_spans.labels("compiled_in_request").inc(len(inline))
        if compile and runs:
            self.metrics.recurring_spans.labels("scheduled").inc(len(runs))
            for start, end in runs:
                self._schedule(tenant, salt, tuple(ids[start:end]), index)

    def _schedule(self, tenant: str, salt: str, run: tuple[int, ...], index: int) -> None:
        """Start one scheduled compile in a free slot, else queue it last, else end it now:
        ``no_anchor``, ``cached`` (the same run queued or compiling), ``skipped_busy`` (queue full)."""
        entries = anchor_entries("span", fingerprint(tenant, run)[:12], tenant, run, self.cfg.spans)
        job = _Job(tenant, KVRef(run, self.chunk_position, salt), index, entries)
        busy = self.in_flight >= self.cfg.compiles_in_flight
        why = ("no_anchor" if not entries else "cached" if job.ref.digest in self._digests
               else "skipped_busy" if busy and (not self.cfg.compiles_in_flight
                                                or len(self._queue) >= self.cfg.compile_queue) else "")
        if why:
            self.metrics.recurring_spans.labels(why).inc()
            return
        self._digests.add(job.ref.digest)
        if busy:
            job.turn = asyncio.get_running_loop().create_future()
            self._queue.append(job)
        else:
            self.in_flight, job.holds = self.in_flight + 1, True
        task = asyncio.get_running_loop().create_task(self._compile(job))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, job))

    def _end(self, job: "_Job", outcome: str) -> None:
        if not job.ended:
            job.ended = True
            self._digests.discard(job.ref.digest)
            self.metrics.recurring_spans.labels(outcome).inc()

    def _release(self, job: "_Job") -> None:
        if not job.holds:
            return
        job.holds = False                   # the slot to the oldest compile still waiting (its turn), else freed
        while self._queue:
            nxt = self._queue.popleft()
            if not nxt.turn.done():         # not cancelled
                nxt.turn.set_result(None)
                nxt.holds = True
                return
        self.in_flight -= 1

    def _done(self, task: asyncio.Task, job: "_Job") -> None:
        """A compile's task done; one cancelled (queued, even before it started) ends as ``failed``."""
        self._tasks.discard(task)
        if job in self._queue:
            self._queue.remove(job)
        self._end(job, "failed")
        self._release(job)

    def _record(self, tenant, key, ids, c, seen, matched, held, inline, units_at=None) -> list[tuple[int, int]]:
        now = time.time()
        if seen:                                    # the match read them without refreshing their LRU: now
            self.state.get_fingerprints(tenant, list(seen), now)
            near = nearest_held(c, seen, exclude=key, max_shift=self.cfg.edit_max_tokens)
            if near is not None:                    # and the held prompt it compared this one with
                self.state.get_held_prompt(tenant, near, now)
        for m in inline:                            # compiled in the request's build: findable from now on
            store_anchors(self.state, tenant, anchor_entries("span", m.name, tenant, m.kv.token_ids, self.cfg.spans),
                          now)
        if self.state.get_held_prompt(tenant, key, now) is not None:
            return []                               # a repeat: its spans were counted the first time
        self.state.put_held_prompt(tenant, key, ids, now)
        counts = self.state.count_fingerprints(tenant, [s.key for s in c.spans], now)
        self.state.put_fingerprints(tenant, {s.key: f"{key}@{s.start}" for s in c.spans
                                             if held or last_seen(seen, s.key) is None}, now)
        earlier = lambda k: self.state.get_held_prompt(tenant, k, now)  # noqa: E731
        covered = [(m.start, m.end) for m in matched]
        runs = recurring_runs(ids, c, counts, seen, earlier, self.cfg, covered, self.is_break)
        if units_at is None or self.text is None or not self.cfg.units_first_sighting:
            return runs
        grown = extended(tenant, ids, c, seen, key, lambda k: self.state.get_held_prompt(tenant, k, now, touch=False))
        if grown:                                   # a growing conversation: its next turn holds it as its prefix
            self.metrics.recurring_spans.labels("units_skipped_extends").inc()
            return runs
        fresh = [u for u in units(ids, units_at, self.text, self.cfg.min_chunk_tokens, self.cfg.unit_label_tokens)
                 if not any(a < u[1] and u[0] < b for a, b in covered + runs)]
        if fresh:
            self.metrics.recurring_spans.labels("unit_first_sighting").inc(len(fresh))
        return runs + fresh

    async def _compile(self, job: "_Job") -> None:
        if job.turn is not None:
            await job.turn              # its turn: a slot handed over by a compile ending (_release)
        try:                            # the slot is held from the gate's wait on: the waiting ones count
            info = await self.background.precompile(job.ref, job.index)    # yields first
            self._release(job)          # the next one waits in the gate while this one's anchors are stored
            await asyncio.to_thread(store_anchors, self.state, job.tenant, job.entries, time.time())
        except Exception as exc:        # the prompt was answered; the span is compiled when it recurs again
            self._end(job, "failed")
            log.warning("compiling a recurring %d-token span failed: %s", len(job.ref.token_ids), exc)
        else:
            self._end(job, "cached" if info.cached else "compiled")
            log.info("recurring %d-token span compiled on its own (%.3f s)", len(job.ref.token_ids), info.seconds)
        finally:
            self._release(job)

    async def drain(self) -> None:
        """Wait for every scheduled bookkeeping task (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def extended(tenant: str, ids: tuple[int, ...], c: Cut, seen: dict, key: str, held) -> int:
    """The length of an earlier kept prompt ``ids`` starts with (0: none): the prompt whose span,
    last seen at the very offset it has here, ends furthest in (``held(key)``: its ids, one read).
    Such a prompt is a turn of a growing conversation: its next turn reaches everything in it
    through the exact prefix (the decode engine's prefix cache, the tier) or the same composition
    again, where a unit compiled now would only be spliced into it, a new recipe every turn (vLLM's
    cache salt with it), so its document-like units are not compiled on this sighting."""
    best = None
    for s in c.spans:
        got = last_seen(seen, s.key)
        if got is not None and got[0] != key and got[1] == s.start and (best is None or s.end > best[1]):
            best = (got[0], s.end)
    old = held(best[0]) if best is not None else None
    if old is None or not 0 < len(old) <= len(ids) or tuple(ids[:len(old)]) != tuple(old):
        return 0
    return len(old)


def store_anchors(state: StateStore, tenant: str, entries: dict[str, str], now: float) -> None:
    """Store a chunk's anchor entries beside the other chunks their keys name (:func:`add_anchors`)."""
    state.put_fingerprints(tenant, add_anchors(state.get_fingerprints(tenant, list(entries), now), entries), now)


def remove_anchors(state: StateStore, tenant: str, keys: list[str], fp: str, now: float) -> None:
    """Take the chunk ``fp`` off its anchor keys, keeping the other chunks they name."""
    keep, gone = drop_anchors(state.get_fingerprints(tenant, keys, now), fp)
    if keep:
        state.put_fingerprints(tenant, keep, now)
    if gone:
        state.delete_fingerprints(tenant, gone)


def _compiled_in_request(matched: list[ChunkMatch], fresh: frozenset[str], plan: RequestPlan | None,
                         fallbacks: tuple[str, ...]) -> list[ChunkMatch]:
    """The fresh spans ``plan`` spliced (a reposition step of the span's own KV): the prefill
    worker compiled each on its own and stored it. None when a KV load failed in the build
    (the step was recomputed in context, nothing may have been stored: the background compile
    takes those)."""
    if plan is None or not fresh or "kv_load_failed" in fallbacks:
        return []
    spliced = {s.kv.digest for s in plan.steps if s.kind is PlanKind.REPOSITION and s.kv is not None}
    return [m for m in matched if m.kv.digest in fresh and m.kv.digest in spliced]


def sighted_notes(kept: list[ChunkMatch], fresh: frozenset[str]) -> list[str]:
    """``explain``'s words for the spans this sighting made recurring."""
    return [f"prompt matching: span:{m.name} at tokens {m.start}-{m.end} recurs (seen in an earlier prompt): where "
            "the policy splices it, it is compiled on its own in this request's build (in its frame, at its canonical "
            "position), stored and spliced, its tokens counted as computed; later prompts reuse it"
            for m in kept if m.kv.digest in fresh]
