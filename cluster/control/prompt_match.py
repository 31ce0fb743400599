"""Prompt matching on the request path: after the longest exact prefix (the prompt index), one
batched state-store read and one batched tier lookup find the chunks this prompt holds at any
offset and the held prompt it edits in one span (:mod:`cluster.control.matching`); what the
prompt teaches is recorded afterwards, off the request path (:mod:`cluster.control.recurring`).

The result is the prompt's context as segments (exact prefix, text, chunks with their KVRef) and
a :class:`~cluster.control.planner.HeldPromptEdit` for the planner, which plans them by the
native rules; the plan's notes say what was matched and where the prompt first diverges from
the nearest held prompt (``explain``).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from cluster.control.fingerprints import Cut, anchors, as_ids, cut, fingerprint
from cluster.control.matching import (ChunkMatch, FoundEdit, MatchConfig, anchor_entries, anchored_chunks, choose,
                                      find_edit, lookup_keys, nearest_held, segments, where)
from cluster.control.planner import (HeldPromptEdit, PlannerConfig, RenderedRequest, RenderedSegment, TierView,
                                     plan_request)
from cluster.control.prompt_index import PROMPT_BLOCK
from cluster.control.recurring import RecurringSpans, remove_anchors, sighted_notes, store_anchors
from cluster.control.reuse_kinds import REUSE_KINDS, reuse_split
from cluster.control.state import StateStore, StateStoreUnavailable
from cluster.control.units import content_ranges
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.lifecycle import Finished, StageClock
    from cluster.control.metrics import Metrics
    from cluster.control.tier_lookup import TierLookup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Matched:
    """One prompt's match (``context`` replaces the prompt's one opaque segment)."""
    key: str                                        # the prompt's key among kept prompts (fingerprints.fingerprint)
    context: tuple[RenderedSegment, ...]
    chunk_keys: frozenset[str] = frozenset()        # digests of the matched chunks the tier holds
    held_edit: HeldPromptEdit | None = None
    chunks: tuple[ChunkMatch, ...] = ()
    cut: Cut | None = None                          # None: matching did not run (nothing to record)
    seen: dict = field(default_factory=dict)        # the entries the match read (recording needs them)
    notes: tuple[str, ...] = ()
    evicted: int = 0                                # tokens of matched spans the tier no longer holds
    fresh: frozenset[str] = frozenset()             # digests of the spans this sighting made recurring (recurring.py)
    messages: tuple = ()                            # (index, role, first token, end) of each message's content
    splices: bool = False                           # the request's policy splices chunks (units compiled for it)


class PromptMatcher:
    def __init__(self, state: StateStore, backends: "Backends", metrics: "Metrics", lookup: "TierLookup",
                 chunk_position: int, cfg: MatchConfig = MatchConfig(),
                 decode: Callable[[list[int]], str] | None = None, background: "Backends | None" = None):
        """``decode``: the model's tokenizer, ids -> text (an erratum needs the changed span's words);
        ``background``: the router's background gate (``YieldingBackends``) the recurring spans'
        background compiles go through (None: ``backends``); a registration's core does not wait."""
        self.state, self.metrics, self.lookup, self.cfg = state, metrics, lookup, cfg
        self.chunk_position, self.decode, self.backends = chunk_position, decode, backends
        text = functools.lru_cache(maxsize=65536)(lambda t: decode([t])) if decode else None
        breaks = (lambda t: "\n" in text(t)) if text else None
        self.recurring = RecurringSpans(state, backends, metrics, cfg, chunk_position, breaks, text, background)

    def core(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """A registered chunk's ids as a prompt pasting its text holds them: without the trailing
        tokens that are only whitespace (a registration ends in ``"\n\n"``, one token at the end
        of a text, two or a merge with the next word inside one)."""
        ids = tuple(ids)
        n = len(ids)
        while n > 1 and self.decode is not None and not self.decode([ids[n - 1]]).strip():
            n -= 1
        return ids[:n]

    async def index_registration(self, tenant: str, kind: str, name: str, ids: tuple[int, ...], salt: str,
                                 index: int) -> None:
        """A registration, findable in any prompt at any offset from now on: its :meth:`core`'s
        anchors stored, and the core compiled on its own like the registration (when it differs
        from it; a failure is counted and the core is compiled on first use instead)."""
        core = self.core(ids)
        self.index_chunk(tenant, kind, name, core)
        if core == tuple(ids) or len(core) < self.cfg.min_chunk_tokens:
            return
        try:
            info = await self.backends.precompile(KVRef(core, self.chunk_position, salt), index)
        except Exception as exc:
            self.metrics.record_fallback("matched_core_precompile_failed")
            log.warning("precompiling %s %r as prompts paste it failed (%s): compiled on first use", kind, name, exc)
            return
        if not info.cached:
            self.metrics.registration_cores.inc()

    def index_chunk(self, tenant: str, kind: str, name: str, ids: tuple[int, ...]) -> None:
        """Store a registered chunk's anchors: prompts holding its ids at any offset match it."""
        entries = anchor_entries(kind, name, tenant, tuple(ids), self.cfg.spans)
        if not entries:
            log.info("%s %r has no anchor (%d tokens): prompts match it only by name", kind, name, len(ids))
            return
        try:
            store_anchors(self.state, tenant, entries, time.time())
        except StateStoreUnavailable as exc:        # registered all the same; prompts just do not find it
            self.metrics.reuse_misses.labels("store_unavailable").inc()
            log.warning("storing %s %r's anchors failed: %s", kind, name, exc)

    def unindex_chunk(self, tenant: str, ids: tuple[int, ...]) -> None:
        """Drop a deleted registration's anchors (the other chunks they name stay)."""
        core = self.core(ids)
        remove_anchors(self.state, tenant, [a.key for a in anchors(tenant, core, self.cfg.spans)],
                       fingerprint(tenant, core), time.time())

    def _ref(self, salt: str):
        return lambda ids: KVRef(tuple(ids), self.chunk_position, salt)

    async def match(self, tenant: str, salt: str, prefix: tuple[int, ...], hit: int, index: int,
                    messages: tuple = (), clock: "StageClock | None" = None) -> Matched:
        """Match ``prefix`` (the prompt but its last token) past its exact prefix of ``hit`` tokens."""
        arr = as_ids(prefix)                            # one conversion: every pass below reads it
        base = Matched(fingerprint(tenant, arr), (RenderedSegment("prompt", None, prefix),) if prefix else ())
        if not self.cfg.enabled or len(prefix) - hit < self.cfg.min_chunk_tokens:
            return base
        c = cut(tenant, arr, self.cfg.spans)
        try:
            seen = self.state.get_fingerprints(tenant, lookup_keys(c), time.time(), touch=False)  # touched when recorded
            chunks = choose(anchored_chunks(tenant, prefix, c, seen, self._ref(salt), hit, arr),
                            self.cfg.min_chunk_tokens)
            fresh = self.recurring.sighted(tenant, salt, base.key, prefix, c, seen, hit,
                                           [(m.start, m.end) for m in chunks])
            chunks = choose(chunks + fresh, self.cfg.min_chunk_tokens) if fresh else chunks
            edit = self._edit(tenant, arr, c, seen, hit, base.key, chunks)
        except StateStoreUnavailable as exc:        # a cache: the prompt is planned on its exact prefix
            self.metrics.reuse_misses.labels("store_unavailable").inc(len(prefix) - hit)
            log.warning("prompt matching skipped: %s", exc)
            return base
        held_refs = _held_refs(edit, salt)
        present = await self.lookup.present([m.kv for m in chunks] + held_refs, index, clock)
        fresh_keys = frozenset(f.kv.digest for f in fresh)
        kept, evicted = self._held_chunks(tenant, chunks, present, fresh_keys)
        held_edit, notes = None, [self._chunk_note(hit, kept)] + sighted_notes(kept, fresh_keys) if kept else []
        if edit is not None:
            found, held = edit
            ref = next((r for r in held_refs if r.digest in present), None)
            at = where(found.start, messages)
            if ref is not None:
                held_edit = HeldPromptEdit(ref, found.start, found.held_end, tuple(prefix[found.start:found.new_end]), at,
                                           *describe(self.decode, held, prefix, found))
            notes.append(f"first divergence from the nearest held prompt ({len(held)} tokens): {at}; it realigns "
                         f"at held token {found.held_end} ({found.equal} of {len(prefix)} tokens equal)"
                         + ("" if held_edit else "; that prompt's KV is not in the tier (evicted, or not stored yet)"))
        elif c.spans and not kept:
            notes.append(f"prompt matching: nothing held matches past the exact prefix of {hit} tokens")
        context = (segments(prefix, hit, kept) if kept else base.context)
        held_keys = frozenset(m.kv.digest for m in kept if m.kv.digest in present or m.kv.digest not in fresh_keys)
        return Matched(base.key, context, held_keys, held_edit, tuple(kept), c, seen, tuple(notes), evicted, fresh_keys,
                       tuple(messages))

    def split_text(self, req: RenderedRequest, tenant: str, salt: str) -> RenderedRequest:
        """A native request outside a session with its text segments matched like a plain
        prompt's: a registered chunk or recurring span pasted into a text is split out of it (one
        batched read of the texts' anchors), planned by the chunk rules. A session's turns keep
        their segments as rendered (its context is compared segment by segment)."""
        texts = {i: np.asarray(seg.token_ids, dtype=np.int64) for i, seg in enumerate(req.context)
                 if seg.kind == "text" and len(seg.token_ids) >= self.cfg.min_chunk_tokens}
        if not self.cfg.enabled or req.session or not texts:
            return req
        cuts = {i: cut(tenant, arr, self.cfg.spans) for i, arr in texts.items()}
        try:
            seen = self.state.get_fingerprints(tenant, [a.key for c in cuts.values() for a in c.anchors], time.time())
        except StateStoreUnavailable as exc:        # a cache: the texts are computed as they are
            log.warning("matching the request's texts skipped: %s", exc)
            return req
        context: list[RenderedSegment] = []
        for i, seg in enumerate(req.context):
            found = choose(anchored_chunks(tenant, seg.token_ids, cuts[i], seen, self._ref(salt), 0, texts[i]),
                           self.cfg.min_chunk_tokens) if i in cuts else []
            context += segments(seg.token_ids, 0, found) if found else [seg]
        return replace(req, context=tuple(context)) if len(context) != len(req.context) else req

    def _edit(self, tenant, prefix, c, seen, hit, key, chunks) -> tuple[FoundEdit, tuple[int, ...]] | None:
        """The nearest earlier prompt and how this one edits it, when editing it reuses more than
        the exact prefix and the matched chunks would."""
        near = nearest_held(c, seen, exclude=key, max_shift=self.cfg.edit_max_tokens)
        # a read only: the entry is touched when this prompt is recorded (recurring.py), off the request path
        held = self.state.get_held_prompt(tenant, near, time.time(), touch=False) if near else None
        found = find_edit(prefix, held, self.cfg) if held else None       # prefix: the prompt's int64 array
        if found is None or found.equal <= hit + sum(m.end - m.start for m in chunks):
            return None
        return found, held

    def _held_chunks(self, tenant: str, chunks: list[ChunkMatch], present: set[str],
                     fresh: frozenset[str] = frozenset()) -> tuple[list[ChunkMatch], int]:
        """The matched chunks to plan: registrations always (one the tier lost is re-warmed by the
        planner's rule), and so the spans this sighting made recurring (``fresh``: compiled in
        the request's build); other recurring spans only while the tier holds them (an evicted
        one's anchors are dropped: it is compiled again if it recurs again)."""
        kept, gone = [], 0
        for m in chunks:
            if m.kind != "span" or m.kv.digest in present or m.kv.digest in fresh:
                kept.append(m)
                continue
            gone += m.end - m.start
            try:
                remove_anchors(self.state, tenant, [a.key for a in anchors(tenant, m.kv.token_ids, self.cfg.spans)],
                               fingerprint(tenant, m.kv.token_ids), time.time())
            except StateStoreUnavailable as exc:
                log.warning("dropping an evicted span's anchors failed: %s", exc)
        if gone:
            self.metrics.reuse_misses.labels("span_evicted").inc(gone)
        return kept, gone

    @staticmethod
    def _chunk_note(hit: int, kept: list[ChunkMatch]) -> str:
        what = ", ".join(f"{m.kind}:{m.name} at tokens {m.start}-{m.end}" for m in kept)
        return f"prompt matching: after the exact prefix of {hit} tokens, {len(kept)} chunk(s) held: {what}"

    async def plan(self, req: RenderedRequest, tenant: str, salt: str, hit: int, hit_kv: KVRef | None, index: int,
                   encode, config: PlannerConfig, messages: tuple = (),
                   clock: "StageClock | None" = None) -> tuple[RequestPlan, Matched]:
        """Plan a plain prompt (``req``: ``Renderer.render_prompt``'s) past its exact prefix of
        ``hit`` tokens: matched, then planned by the native rules; a composed plan whose very
        recipe an earlier request stored is reused whole (its ``approx`` key: the same bytes)."""
        prefix = tuple(req.context[0].token_ids) if req.context else ()
        m = await self.match(tenant, salt, prefix, hit, index, messages, clock)
        choice = config.compose_for(req.policy)
        m = replace(m, splices=req.policy is not Policy.EXACT and (choice is None or choice.allowed))
        req = replace(req, context=m.context)
        tier = TierView(chunk_keys=m.chunk_keys, prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv, held_edit=m.held_edit)
        plan = plan_request(req, tier, None, encode, config)
        if plan.approx and len(prefix) >= PROMPT_BLOCK:
            ref = KVRef(prefix, 0, salt, plan.approx)
            if ref.digest in await self.lookup.present([ref], index, clock):
                plan = plan_request(req, replace(tier, held_context=ref), None, encode, config)
        return (replace(plan, notes=plan.notes + m.notes) if m.notes else plan), m

    async def finished(self, tenant: str, salt: str, prefix: tuple[int, ...], m: Matched, fin: "Finished",
                       index: int, held: bool | None = None) -> None:
        """Count the request's reuse by kind and its misses, and record what the prompt teaches
        (the compiles it triggers run in the background). ``held``: its exact KV is (being) stored
        in the tier (None: it is when the request stored it, exactly)."""
        count_reuse(self.metrics, fin)
        self._count_misses(fin, m, len(prefix))
        if m.cut is not None and self.cfg.enabled:
            # an edit's prompt teaches no recurring span: its equal part is the held prompt's
            await self.recurring.observe(tenant, salt, m.key, prefix, m.cut, m.seen, list(m.chunks), index,
                                   compile=not _edited(fin.plan), fresh=m.fresh, plan=fin.plan,
                                   fallbacks=fin.fallbacks,
                                   held=fin.stored and not fin.plan.approx if held is None else held,
                                   units_at=content_ranges(m.messages, len(prefix)) if m.splices else None)

    def _count_misses(self, fin: "Finished", m: Matched, n: int) -> None:
        """Prompt tokens computed in the ``n``-token prefix, by why they were not reused
        (``kvnotes_reuse_miss_total{reason}``): ``policy`` a matched chunk the policy recomputes,
        ``edit_declined`` a found edit the planner did not take, else ``unmatched``. A plan with no
        steps (the decode engine computed the prompt itself, after what its own prefix cache held)
        counts the prefix tokens nobody reused for it (``fin.cached_tokens`` were)."""
        plan = fin.plan
        names = {f"{c.kind}:{c.name}" for c in m.chunks}
        declined = m.held_edit is not None and not _edited(plan)
        if not plan.steps and n > fin.cached_tokens:
            self.metrics.reuse_misses.labels("edit_declined" if declined else "unmatched").inc(n - fin.cached_tokens)
        for s in plan.steps:
            if s.computed and s.kind is PlanKind.RECOMPUTE:
                why = "policy" if s.source in names else "edit_declined" if declined else "unmatched"
                self.metrics.reuse_misses.labels(why).inc(s.computed)


def _held_refs(edit, salt: str) -> list[KVRef]:
    """The KV of the held prompt an edit would start from: the whole prompt, else its longest
    whole-piece prefix still covering the edited span (the LMCache tier keeps a stored prompt in
    whole ``PROMPT_BLOCK`` pieces: a last, partial piece is not kept)."""
    if edit is None:
        return []
    found, held = edit
    b = len(held) // PROMPT_BLOCK * PROMPT_BLOCK
    whole = [KVRef(tuple(held), 0, salt)]
    return whole + [KVRef(tuple(held[:b]), 0, salt)] if found.held_end <= b < len(held) else whole


def describe(decode, held: tuple[int, ...], new: tuple[int, ...], found: FoundEdit) -> tuple[str, str, str]:
    """(label, old text, new text) of a found edit, for an erratum's wording: the label is the
    text before the last ``:`` or ``=`` on the line the span starts in ("Status: shipped" ->
    "Status"), the texts run from there to the span's end. ("", "", "") without a tokenizer."""
    if decode is None:
        return "", "", ""
    line = decode(list(held[max(0, found.start - 32):found.start])).rsplit("\n", 1)[-1]
    cut = max(line.rfind(":"), line.rfind("="))
    label, lead = (line[:cut].strip(), line[cut + 1:].lstrip()) if cut >= 0 else (line.strip(), "")
    old = lead + decode(list(held[found.start:found.held_end]))
    return label[-64:], old.strip(), (lead + decode(list(new[found.start:found.new_end]))).strip()


def _edited(plan: RequestPlan) -> bool:
    return any(s.kind in (PlanKind.EDIT_IN_PLACE, PlanKind.ERRATUM) for s in plan.steps)


def prompt_store_as(plan: RequestPlan, prefix: tuple[int, ...], salt: str, hit: int) -> KVRef | None:
    """What a plain prompt stores for the next one: its prefix's KV (>= one tier piece), under the
    plan's recipe when approximate; nothing when the tier served all of it already, nor for an
    erratum (the model reads the held prompt + a correction, not this prompt's tokens)."""
    whole = len(plan.steps) == 1 and plan.steps[0].kind is PlanKind.REUSE and plan.steps[0].tokens == len(prefix)
    if len(prefix) < PROMPT_BLOCK or hit >= len(prefix) or whole or PlanKind.ERRATUM in {s.kind for s in plan.steps}:
        return None
    return KVRef(prefix, 0, salt, plan.approx)


def count_reuse(metrics: "Metrics", fin: "Finished") -> None:
    """``kvnotes_reused_tokens_total{kind}`` for one finished request (native or plain)."""
    split = reuse_split(fin.plan, dict(fin.sources))
    for k in REUSE_KINDS:
        if split[k]:
            metrics.reused_tokens.labels(k).inc(split[k])
