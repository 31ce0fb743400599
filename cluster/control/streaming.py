"""A request's way through the router: render, pick a prefill worker, look up the tier, plan,
then hand the plan to the runner (:mod:`cluster.control.lifecycle`) and pass its events on,
remembering a session's context and indexing a stored prompt (:mod:`cluster.control.prompt_index`)
when the request finishes. Native requests (``stream_native``: segments) and plain prompts
(``stream_prompt``: token ids, the OpenAI endpoints) share everything after the plan."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator, Callable

from cluster.control.backends import RequestActivity, YieldConfig, YieldingBackends
from cluster.control.errors import RequestError
from cluster.control.context import Leases, RequestContext
from cluster.control.lifecycle import Finished, PlannedRequest, RequestRunner
from cluster.control.metrics import Metrics
from cluster.control.planner import PlannerConfig, RenderedRequest, SessionContext, TierView, frame_variant, \
    plan_request
from cluster.control.pricing import TokenBudget, exceeds_message
from cluster.control.prompt_index import PROMPT_BLOCK, PromptIndex, prompt_hash
from cluster.control.prompt_logprobs import scored_plan
from cluster.control.prompt_match import PromptMatcher, count_reuse, prompt_store_as
from cluster.control.decode_held import DecodeHeld, prefer_exact, sourced
from cluster.control.render import Renderer
from cluster.control.router_sections import LimitsSection
from cluster.control.routing import NoLiveWorker, WorkerView
from cluster.control.sessions import SessionStore
from cluster.control.store_behind import StoreBehind, StoreBehindConfig, needs_store
from cluster.control.usage_marks import UsageMarks
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan

if TYPE_CHECKING:
    from cluster.control.tier_lookup import TierLookup

log = logging.getLogger(__name__)


class RequestStreams:
    def __init__(self, renderer: Renderer, view: WorkerView, metrics: Metrics, runner: RequestRunner,
                 lookup: "TierLookup", index: PromptIndex, sessions: SessionStore, marks: UsageMarks,
                 limits: LimitsSection, default_policy: Policy, salt: Callable[[str], str],
                 planner_config: Callable[[], PlannerConfig], matcher: "PromptMatcher",
                 store_behind: StoreBehindConfig = StoreBehindConfig(), background: YieldingBackends | None = None):
        """``background``: the one gate background compiles (store-behind, the matcher's recurring
        spans) go through, its ``activity`` counting this replica's requests (the router builds it;
        None: one around ``runner.backends`` with the default :class:`YieldConfig`)."""
        self.renderer, self.view, self.metrics, self.runner = renderer, view, metrics, runner
        self.lookup, self.index, self.sessions, self.marks = lookup, index, sessions, marks
        self.limits, self.default_policy, self.salt = limits, default_policy, salt
        self.planner_config = planner_config
        self.matcher = matcher               # plain prompts past their exact prefix (cluster.control.prompt_match)
        self.decode_held = DecodeHeld(index.state, view, metrics)   # the decode engines' exact prompts (shared hint)
        if background is None:
            background = YieldingBackends(runner.backends, RequestActivity(), YieldConfig(), metrics)
        self.background = background
        self.activity = background.activity   # this replica's requests in flight: background compiles yield to them
        self.store_behind = StoreBehind(background, metrics, index, store_behind, self.decode_held)

    # ---- budget -------------------------------------------------------------------------------
    def budget(self, sampling: SamplingParams) -> TokenBudget:
        """The prompt tokens ``sampling`` leaves in the window, for pricing a request while it is
        tokenised (``cluster.control.pricing``); 400 for a max_tokens past this server's limit."""
        if sampling.max_tokens > self.limits.max_tokens_limit:
            raise RequestError(400, f"max_tokens {sampling.max_tokens} exceeds this server's limit "
                                    f"{self.limits.max_tokens_limit}", param="max_tokens")
        return TokenBudget(self.limits.context_window, sampling.max_tokens, self.renderer.max_chars)

    def check_budget(self, prompt_tokens: int, sampling: SamplingParams) -> None:
        """The exact check, on the planned prompt."""
        self.budget(sampling)
        if prompt_tokens + sampling.max_tokens > self.limits.context_window:
            raise RequestError(400, exceeds_message(f"{prompt_tokens} tokens", sampling.max_tokens,
                                                    self.limits.context_window), code="context_length_exceeded")

    # ---- entry points ---------------------------------------------------------------------------
    async def stream_native(self, ctx: RequestContext, segments: list[dict], *, session: str | None,
                            sampling: SamplingParams, edit: str = "auto") -> AsyncIterator[TokenEvent | Finished]:
        """A native request's events (``ctx``: its id, tenant, policy, deadline, clock, outcome,
        ticket and leases, made at the edge)."""
        try:
            with self.activity.request():
                async for ev in self._stream_native(ctx, segments, session, sampling, edit):
                    yield ev
        finally:
            ctx.leases.release()      # the pick's reservation, at the latest here

    async def stream_prompt(self, ctx: RequestContext, prompt_ids: list[int], *, sampling: SamplingParams,
                            messages: tuple = (), edit: str = "auto") -> AsyncIterator[TokenEvent | Finished]:
        """A plain prompt's events (the OpenAI endpoints: one call per choice). ``messages``:
        (index, role, first token, end) of each chat message's content in ``prompt_ids``
        (``Renderer.chat_ids``), for ``explain`` to name where a prompt diverges; ``edit``: the
        request's ``edit_strategy`` for a held prompt it is found to edit (``edit_plan``)."""
        try:
            with self.activity.request():
                async for ev in self._stream_prompt(ctx, prompt_ids, sampling, messages, edit):
                    yield ev
        finally:
            ctx.leases.release()

    def pick_prefill(self, sticky: str | None, leases: Leases) -> int:
        """Sessions and prompt prefixes prefer one prefill actor (its local tier holds their KV;
        with a shared tier any actor would find them), within a load cap (``cluster.control.routing``)."""
        try:
            index = self.view.pick_prefill(sticky or None)
        except NoLiveWorker as exc:
            raise RequestError(503, str(exc), code="no_live_worker") from None
        leases.add(self.view.lease("prefill", index))
        return index

    # ---- native -------------------------------------------------------------------------------
    async def _stream_native(self, ctx: RequestContext, segments: list[dict], session: str | None,
                             sampling: SamplingParams, edit: str) -> AsyncIterator[TokenEvent | Finished]:
        started, tenant = time.perf_counter(), ctx.tenant
        ctx.lap("validate")                  # since the body was read: the API layer's checks
        salt = self.salt(tenant)
        budget = self.budget(sampling)       # the renderer prices the segments, then charges each one
        req = replace(await asyncio.to_thread(self.renderer.render, ctx.request_id, tenant, segments,
                                              Policy(ctx.policy or self.default_policy.value), session, salt, budget),
                      edit_strategy=edit)      # rendered off the event loop
        req = self.matcher.split_text(req, tenant, salt)   # chunks pasted into its texts (outside sessions)
        ctx.lap("render")
        sess = await asyncio.to_thread(self.sessions.get, tenant, session) if session else None   # off the loop
        prefill_index = self.pick_prefill(f"{tenant}|{session}" if session else None, ctx.leases)
        variant = frame_variant(req.context)       # the first chunk after the frame: exact reuse
        refs = [s.kv for s in req.context if s.kv is not None] + ([sess.context] if sess else []) \
            + ([variant] if variant is not None else [])
        present = await self.lookup.present(refs, prefill_index, ctx.clock)
        now = time.time()
        marks = [(s.kind, s.name, s.kv.digest in present) for s in req.context if s.kv is not None]
        ctx.lap("lookup_state")                  # session, pick, tier lookup (explain.control.worker)
        try:
            if sess is not None and sess.context.digest not in present:
                self.metrics.record_fallback("session_context_evicted")
                log.warning("session %s: cached context no longer in the tier; planning from scratch", session)
                sess = None
            plan = await self._plan_native(req, frozenset(present), sess, tenant, salt, prefill_index, ctx)
            self.check_budget(plan.prompt_tokens, sampling)
            store_as = _native_store_as(plan, session, salt)
            ctx.lap("plan")
            job = PlannedRequest(plan, sampling, store_as, prefill_index, salt, started)
            async for ev in self.runner.run(ctx, job):
                if isinstance(ev, Finished):
                    await self._finished_native(tenant, req, sess, plan, store_as, ev, prefill_index)
                yield ev
                if marks:        # the first event is out: the writes stay off the time to first token
                    self.marks.later(tenant, marks, now)
                    marks = []
        finally:
            if marks:            # the request ended before its first event (an error, the client left)
                self.marks.later(tenant, marks, now)

    async def _finished_native(self, tenant: str, req: RenderedRequest, sess: SessionContext | None,
                               plan: RequestPlan, store_as: KVRef | None, fin: Finished, prefill_index: int) -> None:
        """The state-store writes in a worker thread (never on the event loop: a write waits for the
        store's write lock, up to its busy timeout), awaited before the last event goes out (the
        client's next request finds them)."""
        count_reuse(self.metrics, fin)
        if req.session:
            await asyncio.to_thread(self._remember, tenant, req, sess, plan, store_as if fin.stored else None)
        elif fin.stored and store_as is not None and store_as.exact:
            await asyncio.to_thread(self.index.record, tenant, store_as.token_ids)
        elif needs_store(store_as, fin):          # the decode engine computed the rest: into the tier behind it
            self.store_behind.schedule(tenant, store_as, 0, prefill_index)

    async def _plan_native(self, req: RenderedRequest, present: frozenset, sess, tenant: str, salt: str,
                           prefill_index: int, ctx: RequestContext) -> RequestPlan:
        """Plan a native request; outside a session, the whole context is first looked up as KV the
        tier holds: the exact prefix (the prompt index: an earlier exact plan or plain prompt with
        these tokens) is reused under every policy; else the plan's own recipe, when an earlier
        request stored what it composes (``approx`` key: the same bytes), is reused whole."""
        ids = tuple(t for seg in req.context for t in seg.token_ids)
        held, lone = None, req.session is None      # approximate KV: outside sessions only
        hit_kv, hit = None, 0
        if len(ids) >= PROMPT_BLOCK:                # the exact prefix first, in a session too (planner._reuse_first)
            ref = KVRef(ids, 0, salt)
            if self.index.indexed(tenant, ids) and await self.index.held_whole(ref, prefill_index, ctx.clock):
                held = ref
            else:                                   # else the longest exact prefix held (whole blocks)
                hit_kv, hit = await self.index.longest_held(tenant, salt, ids, prefill_index, ctx.clock)
        config = self.planner_config()
        plan = plan_request(req, TierView(present, prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv, held_context=held),
                            sess, self.renderer.encode, config)
        if held is None and lone and plan.approx and len(ids) >= PROMPT_BLOCK:
            ref = KVRef(ids, 0, salt, plan.approx)
            if await self.index.held_whole(ref, prefill_index, ctx.clock):
                plan = plan_request(req, TierView(present, held_context=ref), sess, self.renderer.encode, config)
        return plan

    def _remember(self, tenant: str, req: RenderedRequest, sess: SessionContext | None, plan: RequestPlan,
                  stored_as: KVRef | None) -> None:
        fields = tuple((s.name, s.fields) for s in req.context if s.kind == "template")
        held = plan.steps[0].kv if len(plan.steps) == 1 and plan.steps[0].source == "context" else None
        if stored_as is None and held is not None and (sess is None or held != sess.context):
            stored_as = held    # the whole context held exactly in the tier: the session's context from now on
        if stored_as is None:
            return          # reused unchanged (nothing new to remember) or the store failed (counted)
        if PlanKind.ERRATUM in {s.kind for s in plan.steps} and sess is not None:
            self.sessions.put(tenant, replace(sess, context=stored_as, token_ids=plan.prefix_ids,
                                              current_fields=fields, errata=sess.errata + 1))
        else:
            self.sessions.put(tenant, SessionContext(req.session, stored_as, req.context, plan.prefix_ids, fields, 0))

    # ---- plain prompts --------------------------------------------------------------------------
    async def _stream_prompt(self, ctx: RequestContext, prompt_ids: list[int], sampling: SamplingParams,
                             messages: tuple = (), edit: str = "auto") -> AsyncIterator[TokenEvent | Finished]:
        started, tenant = time.perf_counter(), ctx.tenant
        ctx.lap("validate")                  # since the body was read: the API layer's checks
        salt = self.salt(tenant)
        self.check_budget(len(prompt_ids), sampling)
        req = replace(self.renderer.render_prompt(ctx.request_id, prompt_ids,
                                                  Policy(ctx.policy or self.default_policy.value)), edit_strategy=edit)
        prefix = tuple(req.context[0].token_ids) if req.context else ()
        sticky = prompt_hash(tenant, prefix[:PROMPT_BLOCK]) if len(prefix) >= PROMPT_BLOCK else None
        prefill_index = self.pick_prefill(sticky, ctx.leases)
        ctx.lap("render")
        hit_kv, hit = await self.index.longest_held(tenant, salt, prefix, prefill_index, ctx.clock)
        ctx.lap("lookup_state")
        if sampling.prompt_logprobs is not None:     # every prompt token computed (cluster.control.prompt_logprobs)
            plan, matched = scored_plan(req, sampling.prompt_logprobs, self.metrics), None
        else:   # the rest matched at any offset (chunks, a held prompt it edits), planned by the native rules
            plan, matched = await self.matcher.plan(req, tenant, salt, hit, hit_kv, prefill_index,
                                                    self.renderer.encode, self.planner_config(), messages, ctx.clock)
            plan = await self._decode_exact_first(tenant, prompt_ids, req, plan, hit, hit_kv)
        self.check_budget(plan.prompt_tokens, sampling)   # an erratum adds its correction to the prompt
        store_as = prompt_store_as(plan, prefix, salt, hit)
        ctx.lap("plan")
        async for ev in self.runner.run(ctx, PlannedRequest(plan, sampling, store_as, prefill_index, salt, started)):
            if isinstance(ev, Finished):
                await self._finished_prompt(tenant, salt, prompt_ids, prefix, plan, matched, store_as, hit, ev,
                                            prefill_index)
            yield ev

    async def _finished_prompt(self, tenant: str, salt: str, prompt_ids: list[int], prefix: tuple[int, ...],
                               plan: RequestPlan, matched, store_as: KVRef | None, hit: int, ev: Finished,
                               prefill_index: int) -> None:
        """A plain prompt's bookkeeping before its last event goes out (the client's next prompt
        finds it): the prompt index or the store behind it, the decode-held record, what it teaches
        prompt matching. State-store writes run in a worker thread, never on the event loop (a
        write waits for the store's write lock, up to its busy timeout, while a store-behind or a
        recording thread holds it: every request of the replica would wait with it)."""
        behind = False
        if ev.stored and store_as is not None and store_as.exact:
            await asyncio.to_thread(self.index.record, tenant, prefix)
        elif needs_store(store_as, ev):      # the decode engine computed it: into the tier behind it
            behind = self.store_behind.schedule(tenant, store_as, hit, prefill_index) == "scheduled"
        if not plan.approx:                  # its exact KV is in the decode engine's prefix cache now
            await asyncio.to_thread(self.decode_held.note, tenant, prompt_ids, ev.summary.engine)
        if matched is None:
            count_reuse(self.metrics, ev)
            return
        await self.matcher.finished(tenant, salt, prefix, matched, ev, prefill_index, held=behind or None)

    async def _decode_exact_first(self, tenant: str, prompt_ids: list[int], req: RenderedRequest,
                                  plan: RequestPlan, hit: int, hit_kv: KVRef | None) -> RequestPlan:
        """An approximate plan gives way to the exact prefix the decode engine's own prefix cache
        holds (:mod:`cluster.control.decode_held`) when that reuses at least as much: planned exact,
        the decode engine computes the rest after it (a growing conversation keeps vLLM's exact
        prefix, as in plain vLLM). Only an approximate plan reads the record (in a worker thread:
        a state-store read, off the event loop)."""
        if not plan.approx:
            return plan
        held = await asyncio.to_thread(self.decode_held.longest, tenant, prompt_ids)
        if not prefer_exact(plan, held, hit):
            return plan
        exact = plan_request(req, TierView(prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv), None, self.renderer.encode,
                             self.planner_config())
        why = (f"the decode engine holds an exact prefix of about {held} tokens (an earlier exact prompt), at least "
               f"the {sourced(plan)} the {plan.kind.value} plan would take from KV: planned exact, its prefix cache "
               "serves them")
        return replace(exact, notes=exact.notes + (why,))


def _native_store_as(plan: RequestPlan, session: str | None, salt: str) -> KVRef | None:
    """What a native request stores for the next one: a session's next turn, or the same request
    again (any policy, ``_plan_native``) reuses it. Nothing for a plan reusing one entry whole."""
    whole_reuse = len(plan.steps) == 1 and plan.steps[0].kind is PlanKind.REUSE
    if plan.steps and not whole_reuse and (session or len(plan.prefix_ids) >= PROMPT_BLOCK):
        return KVRef(plan.prefix_ids, 0, salt, plan.approx)
    return None
