"""The router: render -> plan -> prefill (on a prefill worker) -> decode (streamed from a
decode worker), recording every measurement in :class:`~cluster.control.metrics.Metrics`.

Stateless: registrations, templates, sessions, the prompt-prefix index and the cluster secret
live in the state store (``cluster.control.state``); any number of replicas serve the same cluster and a
restarted one loses nothing. It talks to workers only through :class:`~cluster.control.backends.Backends` (Ray actor
handles in production, see ``cluster.control.ray_backends``); this file renders, plans and keeps
registrations and sessions, and :mod:`cluster.control.lifecycle` executes each plan (prefill, push,
decode, retry, deadline, accounting). Nothing here knows about Ray. KV is named by content (:class:`KVRef`): any prefill worker finds what its
tiers hold without a name map.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from cluster.control.errors import RequestError
from cluster.control.backends import Backends
from cluster.control.lifecycle import CLOCK, Finished, RequestRunner, lap
from cluster.control.metrics import Metrics
from cluster.control.planner import (FidelityTarget, PlannerConfig, RenderedRequest, RenderedSegment, SessionContext,
                                     TierView, choose_edit_kind, frame_variant, plan_request)
from cluster.control.shadow import FidelityGuard, ShadowConfig
from cluster.control.registry import Registry
from cluster.control.pricing import TokenBudget, exceeds_message
from cluster.control.render import Renderer
from cluster.control.routing import FaultPolicy, NoLiveWorker, WorkerLost, WorkerView
from cluster.control.sessions import SessionStore
from cluster.control.usage_marks import UsageMarks
from cluster.control.state import Registration, StateStore, StateStoreUnavailable
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.keys import tenant_salt, token_hash
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan

log = logging.getLogger(__name__)
# Plain-prompt prefix reuse granularity (tokens). Equal to the tier's LMCache piece size
# (kvtransport.tier.store_config.TierConfig.chunk_size): a stored prompt serves every prefix of it that
# ends on a piece boundary, so the index records exactly those boundaries (and the whole prefix).
PROMPT_BLOCK = 256


class Router:
    def __init__(self, backends: Backends, renderer: Renderer, state: StateStore, model_id: str, dtype: str, *,
                 metrics: Metrics | None = None, default_policy: str = "balanced", seam_tokens: int = 1,
                 fidelity_summary: dict | None = None, context_window: int = 8192, max_tokens_limit: int = 2048,
                 default_tenant: str = "default", balanced_min_top1: float = 0.95,
                 balanced_target: FidelityTarget | None = None,
                 fast_min_top1: float | None = None, shadow: ShadowConfig | None = None,
                 decode_computes_cold: bool = False, served_model: str | None = None):
        self.backends, self.renderer, self.state = backends, renderer, state
        self.served_model = served_model or renderer.spec.name     # the API's `model` (clients send and see)
        self.model_id, self.dtype = model_id, dtype
        self.registry: Registry = renderer.registry
        self.metrics = metrics or Metrics()
        self.sessions = SessionStore(state)
        self.default_policy = Policy(default_policy)
        targets = {Policy.BALANCED: balanced_target or FidelityTarget.answers(min_top1=balanced_min_top1)}
        self.edit_choice = choose_edit_kind(fidelity_summary, min_top1=targets[Policy.BALANCED].minimum)
        if fast_min_top1 is not None:
            targets[Policy.FAST] = FidelityTarget("top1", fast_min_top1)
        self.guard = FidelityGuard(fidelity_summary, targets, shadow or ShadowConfig(), self.metrics,
                                   lambda i, plan: self.backends.shadow(i, plan),
                                   PlannerConfig(seam_tokens=seam_tokens, edit=self.edit_choice,
                                                 decode_computes_cold=decode_computes_cold))
        self.context_window, self.max_tokens_limit = context_window, max_tokens_limit
        self.default_tenant = default_tenant
        self._secret = state.secret()          # the same for every replica: keys agree cluster-wide
        self.view: WorkerView = backends.view
        self.fault: FaultPolicy = backends.fault_policy
        self.marks = UsageMarks(state, self.metrics)     # registrations' last use, written off the request path
        self.runner = RequestRunner(backends, self.view, self.fault, self.metrics, dtype, self.guard, default_tenant)
        backends.start_health(self.metrics)

    @property
    def planner_config(self) -> PlannerConfig:
        return self.guard.planner_config()           # re-chosen when shadow checks demote/readmit an op

    @property
    def fidelity(self) -> dict:
        """Targets, each policy's compose op and why, shadow-check windows and demotions."""
        return self.guard.snapshot()

    def salt(self, tenant: str) -> str:
        return tenant_salt(tenant, self._secret)

    # ---- registration ---------------------------------------------------------------------
    async def register_chunk(self, kind: str, tenant: str, name: str, text: str) -> dict:
        if not isinstance(text, str) or not text.strip():
            raise RequestError(400, f"{kind} text must be a non-empty string", param="text")
        low = TokenBudget(self.context_window, 16, self.renderer.max_chars).lower_bound(len(text.strip()))
        if low + 16 > self.context_window:          # cannot fit: refused before it is tokenised
            raise RequestError(400, f"{kind} is at least {low} tokens ({len(text)} characters); the model's window "
                                    f"is {self.context_window}")
        ids = await asyncio.to_thread(self.renderer.chunk_ids, text)     # tokenize off the event loop
        if len(ids) + 16 > self.context_window:
            raise RequestError(400, f"{kind} is {len(ids)} tokens; the model's window is {self.context_window}")
        ref = self.renderer.chunk_ref(ids, self.salt(tenant))
        try:
            first = self.view.pick_prefill(None)
        except NoLiveWorker:
            first = 0              # the view may be stale: precompile still tries every actor
        info = await self.backends.precompile(ref, first)
        now = time.time()
        old = self.state.get_registration(tenant, kind, name)
        self.registry.add_chunk(Registration(tenant, kind, name, text, ids, token_hash(ids), ref.digest,
                                             old.created if old else now, now, True))
        self.metrics.registrations.labels(kind, "cached" if info.cached else "compiled").inc()
        out = {"name": name, "kind": kind, "tokens": len(ids), "key": ref.digest, "cached": info.cached,
               "bytes": info.bytes, "seconds": info.seconds, "worker": info.worker}
        variant = self._frame_variant(kind, name, ids, ref)
        if variant is not None:          # the first request after the default frame pays no compile
            try:
                v = await self.backends.precompile(variant, first)
            except Exception as exc:     # registered all the same: the variant compiles on first use
                self.metrics.record_fallback("frame_variant_precompile_failed")
                log.warning("precompiling %s %r after the chat frame failed (%s): compiled on first use", kind,
                            name, exc)
            else:
                if not v.cached:
                    self.metrics.chunk_variants.inc()
                    log.info("%s %r precompiled after the %d-token chat frame (%d tokens, %.3f s)", kind, name,
                             len(variant.token_ids) - len(ids), len(variant.token_ids), v.seconds)
                out["frame_variant"] = {"key": variant.digest, "cached": v.cached, "seconds": v.seconds}
        return out

    def _frame_variant(self, kind: str, name: str, ids: tuple[int, ...], ref: KVRef) -> KVRef | None:
        """The chunk's variant after this model's default chat frame (None: the model has none)."""
        if not self.renderer.spec.chat_user_prefix or not self.renderer.frame():
            return None
        return frame_variant((RenderedSegment("frame", None, self.renderer.frame()),
                              RenderedSegment(kind, name, tuple(ids), kv=ref)))

    async def delete_chunk(self, kind: str, tenant: str, name: str) -> dict:
        c = self.registry.remove_chunk(tenant, kind, name)
        shared = any(o.key == c.key for k in ("skill", "memory") for o in self.registry.chunks(tenant, k))
        ref = self.renderer.chunk_ref(c.token_ids, self.salt(tenant))
        evicted = False if shared else await self.backends.evict(ref)
        variant = None if shared else self._frame_variant(kind, name, c.token_ids, ref)
        if variant is not None:
            await self.backends.evict(variant)
        return {"name": name, "kind": kind, "deleted": True, "evicted": evicted}

    async def listing(self, kind: str, tenant: str) -> list[dict]:
        """Registrations with their in-tier status, looked up now (counted as tier lookups)."""
        regs = self.registry.chunks(tenant, kind)
        present = await self._present([self.renderer.chunk_ref(r.token_ids, self.salt(tenant)) for r in regs])
        out = []
        for r in regs:
            in_tier = self.renderer.chunk_ref(r.token_ids, self.salt(tenant)).digest in present
            if in_tier != r.in_tier:
                self.state.mark_used(tenant, kind, r.name, r.last_used, in_tier)
            out.append({"name": r.name, "tokens": len(r.token_ids), "key": r.key, "in_tier": in_tier,
                        "created": r.created, "last_used": r.last_used})
        return out

    # ---- requests ---------------------------------------------------------------------------
    def budget(self, sampling: SamplingParams) -> TokenBudget:
        """The prompt tokens ``sampling`` leaves in the window, for pricing a request while it is
        tokenised (``cluster.control.pricing``); 400 for a max_tokens past this server's limit."""
        if sampling.max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"max_tokens {sampling.max_tokens} exceeds this server's limit "
                                    f"{self.max_tokens_limit}", param="max_tokens")
        return TokenBudget(self.context_window, sampling.max_tokens, self.renderer.max_chars)

    def _check_budget(self, prompt_tokens: int, sampling: SamplingParams) -> None:
        """The exact check, on the planned prompt."""
        self.budget(sampling)
        if prompt_tokens + sampling.max_tokens > self.context_window:
            raise RequestError(400, exceeds_message(f"{prompt_tokens} tokens", sampling.max_tokens,
                                                    self.context_window), code="context_length_exceeded")

    async def _present(self, refs: list[KVRef], index: int = 0) -> set[str]:
        """Digests of ``refs`` the chosen prefill worker's tiers hold. Every plan-time lookup is
        counted (misses included) in ``kvnotes_tier_lookups_total{tier="lmcache"}``."""
        if not refs:
            return set()
        t = time.perf_counter()
        try:
            got = await self.backends.contains(refs, index)
            clock = CLOCK.get()
            if clock is not None:
                clock.add("tier_lookup", time.perf_counter() - t)
        except WorkerLost as exc:    # plan as if nothing is cached; _run retries the prefill elsewhere
            self.metrics.record_fallback("tier_lookup_worker_lost")
            log.warning("tier lookup failed (%s): planning without cached KV", exc)
            return set()
        self.metrics.tier_lookups.labels("lmcache").inc(len(refs))
        self.metrics.tier_hits.labels("lmcache").inc(sum(got))
        return {r.digest for r, ok in zip(refs, got) if ok}

    async def stream_native(self, *a, **kw) -> AsyncIterator[TokenEvent | Finished]:
        """A native request's events. ``request_id``: the request's id from the edge (the plan's,
        every transfer's prefix and every worker message's; drawn here when None)."""
        async for ev in self._leased(self._stream_native, *a, **kw):
            yield ev

    async def stream_prompt(self, *a, **kw) -> AsyncIterator[TokenEvent | Finished]:
        async for ev in self._leased(self._stream_prompt, *a, **kw):
            yield ev

    async def _leased(self, fn, *a, **kw):
        """Run a request holding the prefill lease its pick took, released at the latest here."""
        leases: list = []
        try:
            async for ev in fn(leases, *a, **kw):
                yield ev
        finally:
            for lease in leases:
                lease.release()

    async def _stream_native(self, leases: list, tenant: str, segments: list[dict], *, policy: str | None,
                             session: str | None, sampling: SamplingParams, edit: str = "auto",
                             deadline_s: float | None = None,
                             request_id: str | None = None) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        clock = CLOCK.get()
        lap(clock, "validate")               # since the body was read: the API layer's checks
        rid = request_id or uuid.uuid4().hex
        salt = self.salt(tenant)
        budget = self.budget(sampling)       # the renderer prices the segments, then charges each one
        req = replace(await asyncio.to_thread(self.renderer.render, rid, tenant, segments,      # off the event loop
                                              Policy(policy or self.default_policy.value), session, salt, budget),
                      edit_strategy=edit)
        lap(clock, "render")
        sess = self.sessions.get(tenant, session) if session else None
        pi = self._pick_prefill(f"{tenant}|{session}" if session else None, leases)
        variant = frame_variant(req.context)       # the first chunk after the frame: exact reuse
        refs = [s.kv for s in req.context if s.kv is not None] + ([sess.context] if sess else []) \
            + ([variant] if variant is not None else [])
        present = await self._present(refs, pi)
        now = time.time()
        marks = [(s.kind, s.name, s.kv.digest in present) for s in req.context if s.kv is not None]
        lap(clock, "lookup_state")               # session, pick, tier lookup (explain.control.worker)
        try:
            if sess is not None and sess.context.digest not in present:
                self.metrics.record_fallback("session_context_evicted")
                log.warning("session %s: cached context no longer in the tier; planning from scratch", session)
                sess = None
            plan = await self._plan_native(req, frozenset(present), sess, tenant, salt, pi)
            self._check_budget(plan.prompt_tokens, sampling)
            store_as = None
            whole_reuse = len(plan.steps) == 1 and plan.steps[0].kind is PlanKind.REUSE
            if plan.steps and not whole_reuse and (session or len(plan.prefix_ids) >= PROMPT_BLOCK):
                # a session's next turn, or the same request again (any policy, _plan_native), reuses it
                store_as = KVRef(plan.prefix_ids, 0, salt, plan.approx)
            lap(clock, "plan")
            async for ev in self.runner.run(plan, sampling, t0, store_as, pi, salt, deadline_s, leases, tenant, clock):
                if isinstance(ev, Finished) and session:
                    self._remember(tenant, req, sess, plan, store_as if ev.stored else None)
                elif isinstance(ev, Finished) and ev.stored and store_as is not None and store_as.exact:
                    self._index_prompt(tenant, store_as.token_ids)
                yield ev
                if marks:        # the first event is out: the writes stay off the time to first token
                    self.marks.later(tenant, marks, now)
                    marks = []
        finally:
            if marks:            # the request ended before its first event (an error, the client left)
                self.marks.later(tenant, marks, now)

    async def _plan_native(self, req, present: frozenset, sess, tenant: str, salt: str, pi: int) -> RequestPlan:
        """Plan a native request; outside a session, the whole context is first looked up as KV the
        tier holds: the exact prefix (the prompt index: an earlier exact plan or plain prompt with
        these tokens) is reused under every policy; else the plan's own recipe, when an earlier
        request stored what it composes (``approx`` key: the same bytes), is reused whole."""
        ids = tuple(t for seg in req.context for t in seg.token_ids)
        held, lone = None, req.session is None      # a session's turns go through its own context
        if lone and len(ids) >= PROMPT_BLOCK:       # the whole context only: one hash, one tier lookup
            try:
                indexed = self.state.get_prompt_blocks(tenant, [_h(tenant, ids)], time.time())
            except StateStoreUnavailable as exc:        # the index is a cache: plan without it
                self._prompt_index_unavailable(exc)
                indexed = {}
            ref = KVRef(ids, 0, salt)
            held = ref if indexed and ref.digest in await self._present([ref], pi) else None
        plan = plan_request(req, TierView(present, held_context=held), sess, self.renderer.encode, self.planner_config)
        if held is None and lone and plan.approx and len(ids) >= PROMPT_BLOCK:
            ref = KVRef(ids, 0, salt, plan.approx)
            if ref.digest in await self._present([ref], pi):
                plan = plan_request(req, TierView(present, held_context=ref), sess, self.renderer.encode,
                                    self.planner_config)
        return plan

    def _index_prompt(self, tenant: str, prefix: tuple[int, ...]) -> None:
        """Record ``prefix``'s block boundaries (and its length) in the prompt index: it is stored."""
        bounds = {*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)}
        try:
            self.state.put_prompt_blocks(tenant, {_h(tenant, prefix[:b]): b for b in bounds}, time.time())
        except StateStoreUnavailable as exc:    # the answer stands; the prefix is just not indexed
            self._prompt_index_unavailable(exc)

    async def _stream_prompt(self, leases: list, tenant: str, prompt_ids: list[int], *, policy: str | None,
                             sampling: SamplingParams, deadline_s: float | None = None,
                             request_id: str | None = None) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        clock = CLOCK.get()
        lap(clock, "validate")               # since the body was read: the API layer's checks
        rid = request_id or uuid.uuid4().hex
        salt = self.salt(tenant)
        self._check_budget(len(prompt_ids), sampling)
        req = self.renderer.render_prompt(rid, prompt_ids, Policy(policy or self.default_policy.value))
        prefix = tuple(req.context[0].token_ids) if req.context else ()
        pi = self._pick_prefill(_h(tenant, prefix[:PROMPT_BLOCK]) if len(prefix) >= PROMPT_BLOCK else None, leases)
        lap(clock, "render")
        hit_kv, hit = await self._prompt_lookup(tenant, salt, prefix, pi)
        lap(clock, "lookup_state")
        plan = plan_request(req, TierView(prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv), None,
                            self.renderer.encode, self.planner_config)
        store_as = None
        if len(prefix) >= PROMPT_BLOCK and hit < len(prefix):
            store_as = KVRef(prefix, 0, salt)
        lap(clock, "plan")
        async for ev in self.runner.run(plan, sampling, t0, store_as, pi, salt, deadline_s, leases, tenant, clock):
            if isinstance(ev, Finished) and ev.stored:
                self._index_prompt(tenant, prefix)
            yield ev

    async def _prompt_lookup(self, tenant: str, salt: str, prefix: tuple[int, ...], pi: int) -> tuple[KVRef | None, int]:
        """Longest indexed prefix of ``prefix`` that the prefill worker's tier still holds. Every
        indexed boundary is checked in one batched lookup; when longer ones were evicted (the
        index outlives the tier's LRU) the longest present one is used, counted as
        ``kvnotes_fallbacks_total{reason="prompt_prefix_evicted"}``."""
        bounds = sorted({*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)} - {0}, reverse=True)
        if len(prefix) < PROMPT_BLOCK:
            bounds = [len(prefix)] if prefix else []
        hashes = {b: _h(tenant, prefix[:b]) for b in bounds}
        try:
            known = self.state.get_prompt_blocks(tenant, list(hashes.values()), time.time())
        except StateStoreUnavailable as exc:            # the index is a cache: plan as a miss
            self._prompt_index_unavailable(exc)
            return None, 0
        cands = [b for b in bounds if hashes[b] in known]                # longest first
        refs = [KVRef(prefix[:b], 0, salt) for b in cands]
        present = await self._present(refs, pi)
        for b, ref in zip(cands, refs):
            if ref.digest in present:
                if b != cands[0]:
                    self.metrics.record_fallback("prompt_prefix_evicted")
                    log.info("prompt prefix of %d tokens no longer in the tier: reusing %d", cands[0], b)
                return ref, b
        return None, 0

    def _prompt_index_unavailable(self, exc: StateStoreUnavailable) -> None:
        self.metrics.record_fallback("prompt_index_unavailable")
        log.warning("prompt index skipped (the prompt is computed, not reused): %s", exc)

    # ---- lifecycle --------------------------------------------------------------------------
    def _pick_prefill(self, sticky: str | None, leases: list) -> int:
        """Sessions and prompt prefixes prefer one prefill actor (its local tier holds their KV;
        with a shared tier any actor would find them), within a load cap (``cluster.control.routing``)."""
        try:
            i = self.view.pick_prefill(sticky or None)
        except NoLiveWorker as exc:
            raise RequestError(503, str(exc), code="no_live_worker") from None
        leases.append(self.view.lease("prefill", i))
        return i

    def _remember(self, tenant: str, req: RenderedRequest, sess: SessionContext | None, plan: RequestPlan,
                  stored_as: KVRef | None) -> None:
        fields = tuple((s.name, s.fields) for s in req.context if s.kind == "template")
        if stored_as is None:
            return          # reused unchanged (nothing new to remember) or the store failed (counted)
        if PlanKind.ERRATUM in {s.kind for s in plan.steps} and sess is not None:
            self.sessions.put(tenant, replace(sess, context=stored_as, token_ids=plan.prefix_ids,
                                              current_fields=fields, errata=sess.errata + 1))
        else:
            self.sessions.put(tenant, SessionContext(req.session, stored_as, req.context, plan.prefix_ids, fields, 0))


def _h(tenant: str, ids) -> str:
    return hashlib.sha256((tenant + "|" + ",".join(map(str, ids))).encode()).hexdigest()[:32]
