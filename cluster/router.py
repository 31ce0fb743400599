"""The router: render -> plan -> prefill (on a prefill worker) -> decode (streamed from a
decode worker), recording every measurement in :class:`~cluster.metrics.Metrics`.

Stateless: registrations, templates, sessions, the prompt-prefix index and the cluster secret
live in the state store (``cluster.state``); any number of replicas serve the same cluster and a
restarted one loses nothing. It talks to workers only through :class:`Backends` (Ray actor
handles in production, see ``cluster.ray_backends``), so this file holds the request lifecycle
and nothing about Ray. KV is named by content (:class:`KVRef`): any prefill worker finds what its
tiers hold without a name map.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol

from cluster.errors import RequestError
from cluster.metrics import Metrics, note_plan
from cluster.planner import (FidelityTarget, PlannerConfig, RenderedRequest, SessionContext, TierView, choose_edit_kind,
                             plan_request)
from cluster.shadow import FidelityGuard, ShadowConfig
from cluster.registry import Registry
from cluster.render import Renderer
from cluster.routing import DeadlineExceeded, FaultPolicy, NoLiveWorker, WorkerLost, WorkerView
from cluster.sessions import SessionStore
from cluster.state import Registration, StateStore
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.messages.keys import tenant_salt, token_hash
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan
from kvruntime.messages.prefill import PrecompileInfo, PrefillResult
from kvruntime.messages.transfer import STAGES, TransferGrant

log = logging.getLogger(__name__)
# Plain-prompt prefix reuse granularity (tokens). Equal to the tier's LMCache piece size
# (kvtransport.lmcache_store.TierConfig.chunk_size): a stored prompt serves every prefix of it that
# ends on a piece boundary, so the index records exactly those boundaries (and the whole prefix).
PROMPT_BLOCK = 256
# Fallbacks after which the request still executed as planned (only storing its KV failed).
STORE_ONLY_FALLBACKS = frozenset({"tier_store_failed"})


class Backends(Protocol):
    num_prefill: int
    num_decode: int

    async def contains(self, refs: list[KVRef], index: int = 0) -> list[bool]: ...
    async def precompile(self, ref: KVRef, index: int = 0) -> PrecompileInfo: ...
    async def evict(self, ref: KVRef) -> bool: ...
    async def expect(self, decode_index: int, grant: TransferGrant, prefix: tuple[int, ...], salt: str) -> int: ...
    async def prefill(self, index: int, plan: RequestPlan, decode_index: int, transfer_id: str,
                      store_as: KVRef | None, *, credential: str, send_from: int = 0) -> PrefillResult: ...
    async def shadow(self, index: int, plan: RequestPlan): ...   # -> messages.fidelity.ShadowResult
    def decode(self, index: int, transfer_id: str | None, prefix: tuple[int, ...], suffix: tuple[int, ...],
               sampling: SamplingParams, salt: str) -> AsyncIterator[TokenEvent | DecodeSummary]: ...
    # Optional (cluster.ray_backends): ``view`` (routing.WorkerView), ``fault_policy``
    # (routing.FaultPolicy), ``start_health(metrics)``, and ``cancel(index, key)`` with
    # ``decode(..., cancel_key=key)``. Worker deaths are raised as routing.WorkerLost.


@dataclass(frozen=True)
class Finished:
    """Last event of a request: what the API layer needs for ``usage`` and ``explain``."""
    plan: RequestPlan
    summary: DecodeSummary
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int             # prompt tokens whose KV was loaded (reused + repositioned)
    fallbacks: tuple[str, ...]
    stored: bool = False           # the prefix KV was stored in the tier for the next request
    stages: tuple[tuple[str, float], ...] = ()   # KV path seconds per stage (transfer.STAGES order)
    transport: str = ""            # what carried the prefix KV (nixl | grpc; "" if none was sent)


class Router:
    def __init__(self, backends: Backends, renderer: Renderer, state: StateStore, model_id: str, dtype: str, *,
                 metrics: Metrics | None = None, default_policy: str = "balanced", seam_tokens: int = 1,
                 fidelity_summary: dict | None = None, context_window: int = 8192, max_tokens_limit: int = 2048,
                 default_tenant: str = "default", balanced_min_top1: float = 0.97,
                 fast_min_top1: float | None = None, shadow: ShadowConfig | None = None):
        self.backends, self.renderer, self.state = backends, renderer, state
        self.model_id, self.dtype = model_id, dtype
        self.registry: Registry = renderer.registry
        self.metrics = metrics or Metrics()
        self.sessions = SessionStore(state)
        self.default_policy = Policy(default_policy)
        self.edit_choice = choose_edit_kind(fidelity_summary)
        targets = {Policy.BALANCED: FidelityTarget("top1", balanced_min_top1)}
        if fast_min_top1 is not None:
            targets[Policy.FAST] = FidelityTarget("top1", fast_min_top1)
        self.guard = FidelityGuard(fidelity_summary, targets, shadow or ShadowConfig(), self.metrics,
                                   lambda i, plan: self.backends.shadow(i, plan),
                                   PlannerConfig(seam_tokens=seam_tokens, edit=self.edit_choice))
        self.context_window, self.max_tokens_limit = context_window, max_tokens_limit
        self.default_tenant = default_tenant
        self._secret = state.secret()          # the same for every replica: keys agree cluster-wide
        self.view: WorkerView = getattr(backends, "view", None) or WorkerView(backends.num_prefill,
                                                                               backends.num_decode)
        self.fault: FaultPolicy = getattr(backends, "fault_policy", None) or FaultPolicy()
        if hasattr(backends, "start_health"):
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
        return {"name": name, "kind": kind, "tokens": len(ids), "key": ref.digest, "cached": info.cached,
                "bytes": info.bytes, "seconds": info.seconds, "worker": info.worker}

    async def delete_chunk(self, kind: str, tenant: str, name: str) -> dict:
        c = self.registry.remove_chunk(tenant, kind, name)
        shared = any(o.key == c.key for k in ("skill", "memory") for o in self.registry.chunks(tenant, k))
        evicted = False if shared else await self.backends.evict(self.renderer.chunk_ref(c.token_ids,
                                                                                         self.salt(tenant)))
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
    def _check_budget(self, prompt_tokens: int, sampling: SamplingParams) -> None:
        if sampling.max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"max_tokens {sampling.max_tokens} exceeds this server's limit "
                                    f"{self.max_tokens_limit}", param="max_tokens")
        if prompt_tokens + sampling.max_tokens > self.context_window:
            raise RequestError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                                    f"the model's context window of {self.context_window} tokens",
                               code="context_length_exceeded")

    async def _present(self, refs: list[KVRef], index: int = 0) -> set[str]:
        """Digests of ``refs`` the chosen prefill worker's tiers hold. Every plan-time lookup is
        counted (misses included) in ``kvnotes_tier_lookups_total{tier="lmcache"}``."""
        if not refs:
            return set()
        try:
            got = await self.backends.contains(refs, index)
        except WorkerLost as exc:    # plan as if nothing is cached; _run retries the prefill elsewhere
            self.metrics.record_fallback("tier_lookup_worker_lost")
            log.warning("tier lookup failed (%s): planning without cached KV", exc)
            return set()
        self.metrics.tier_lookups.labels("lmcache").inc(len(refs))
        self.metrics.tier_hits.labels("lmcache").inc(sum(got))
        return {r.digest for r, ok in zip(refs, got) if ok}

    async def stream_native(self, *a, **kw) -> AsyncIterator[TokenEvent | Finished]:
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
                             deadline_s: float | None = None) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        salt = self.salt(tenant)
        req = replace(await asyncio.to_thread(self.renderer.render, rid, tenant, segments,      # off the event loop
                                              Policy(policy or self.default_policy.value), session, salt),
                      edit_strategy=edit)
        sess = self.sessions.get(tenant, session) if session else None
        pi = self._pick_prefill(f"{tenant}|{session}" if session else None, leases)
        refs = [s.kv for s in req.context if s.kv is not None] + ([sess.context] if sess else [])
        present = await self._present(refs, pi)
        now = time.time()
        for s in req.context:
            if s.kv is not None:
                self.state.mark_used(tenant, s.kind, s.name, now, s.kv.digest in present)
        if sess is not None and sess.context.digest not in present:
            self.metrics.record_fallback("session_context_evicted")
            log.warning("session %s: cached context no longer in the tier; planning from scratch", session)
            sess = None
        plan = plan_request(req, TierView(frozenset(present)), sess, self.renderer.encode, self.planner_config)
        self._check_budget(plan.prompt_tokens, sampling)
        store_as = None
        if session and plan.steps and not (len(plan.steps) == 1 and plan.steps[0].kind is PlanKind.REUSE):
            store_as = KVRef(plan.prefix_ids, 0, salt, plan.approx)
        async for ev in self._run(plan, sampling, t0, store_as, pi, salt, deadline_s, leases, tenant):
            if isinstance(ev, Finished) and session:
                self._remember(tenant, req, sess, plan, store_as if ev.stored else None)
            yield ev

    async def _stream_prompt(self, leases: list, tenant: str, prompt_ids: list[int], *, policy: str | None,
                             sampling: SamplingParams,
                             deadline_s: float | None = None) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        salt = self.salt(tenant)
        self._check_budget(len(prompt_ids), sampling)
        req = self.renderer.render_prompt(rid, prompt_ids, Policy(policy or self.default_policy.value))
        prefix = tuple(req.context[0].token_ids) if req.context else ()
        pi = self._pick_prefill(_h(tenant, prefix[:PROMPT_BLOCK]) if len(prefix) >= PROMPT_BLOCK else None, leases)
        hit_kv, hit = await self._prompt_lookup(tenant, salt, prefix, pi)
        plan = plan_request(req, TierView(prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv), None,
                            self.renderer.encode, self.planner_config)
        store_as = None
        if len(prefix) >= PROMPT_BLOCK and hit < len(prefix):
            store_as = KVRef(prefix, 0, salt)
        async for ev in self._run(plan, sampling, t0, store_as, pi, salt, deadline_s, leases, tenant):
            if isinstance(ev, Finished) and ev.stored:
                bounds = {*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)}
                self.state.put_prompt_blocks(tenant, {_h(tenant, prefix[:b]): b for b in bounds}, time.time())
            yield ev

    async def _prompt_lookup(self, tenant: str, salt: str, prefix: tuple[int, ...], pi: int) -> tuple[KVRef | None, int]:
        """Longest indexed prefix of ``prefix`` that the prefill worker's tier still holds."""
        bounds = sorted({*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)} - {0}, reverse=True)
        if len(prefix) < PROMPT_BLOCK:
            bounds = [len(prefix)] if prefix else []
        hashes = {b: _h(tenant, prefix[:b]) for b in bounds}
        known = self.state.get_prompt_blocks(tenant, list(hashes.values()), time.time())
        for b in bounds:
            if hashes[b] in known:
                ref = KVRef(prefix[:b], 0, salt)
                if ref.digest in await self._present([ref], pi):
                    return ref, b
                return None, 0
        return None, 0

    # ---- lifecycle --------------------------------------------------------------------------
    def _pick_prefill(self, sticky: str | None, leases: list) -> int:
        """Sessions and prompt prefixes prefer one prefill actor (its local tier holds their KV;
        with a shared tier any actor would find them), within a load cap (``cluster.routing``)."""
        try:
            i = self.view.pick_prefill(sticky or None)
        except NoLiveWorker as exc:
            raise RequestError(503, str(exc), code="no_live_worker") from None
        leases.append(self.view.lease("prefill", i))
        return i

    async def _run(self, plan: RequestPlan, sampling: SamplingParams, t0: float,
                   store_as: KVRef | None, pi: int, salt: str,
                   deadline_s: float | None = None, leases: list = (),
                   tenant: str | None = None) -> AsyncIterator[TokenEvent | Finished]:
        """Prefill then decode, on the least loaded live decode worker. A worker lost before the
        first token: retried on another one (``request_retries``); lost mid-stream: a clear
        error. Past the deadline: the decode worker is told to stop; 504. All counted."""
        m = self.metrics
        kind = plan.kind.value
        note_plan(kind)                            # the API layer's label for it if it is abandoned
        deadline = t0 + min(deadline_s or self.fault.deadline_s, self.fault.deadline_s)
        tried = {"prefill": set(), "decode": set()}
        attempt, ttft, sent = 0, None, 0
        while True:
            try:
                di = self.view.pick_decode(exclude=tried["decode"])
                if pi in tried["prefill"] or not self.view.is_alive("prefill", pi):
                    pi = self.view.pick_prefill(None, exclude=tried["prefill"])
            except NoLiveWorker as exc:
                m.count_request(kind, "no_live_worker")
                raise RequestError(503, str(exc), code="no_live_worker") from None
            tid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
            self.view.begin("decode", di, sampling.max_tokens)
            try:
                res = None
                if plan.steps:
                    self.view.begin("prefill", pi, plan.prompt_tokens)
                    for lease in leases:
                        lease.release()            # the pick's reservation becomes this call's load
                    try:
                        # the decode actor accepts this block only: credential (the prefill actor's
                        # alone), shape, dtype
                        grant, cred = TransferGrant.issue(tid, plan.model, self.dtype, plan.prefix_ids)
                        # ship nothing twice: the decode actor says how much of the prefix it holds
                        held = await self._before(deadline, "prefill", self.backends.expect(
                            di, grant, plan.prefix_ids, plan.kv_salt(salt)))
                        res = await self._before(deadline, "prefill", self.backends.prefill(
                            pi, plan, di, tid, store_as, credential=cred, send_from=held))
                    finally:
                        self.view.end("prefill", pi, plan.prompt_tokens)
                fallbacks = list(res.stats.fallbacks) if res else []
                extra = {"cancel_key": tid} if hasattr(self.backends, "cancel") else {}
                gen = self.backends.decode(di, tid if res is not None and res.transferred else None,
                                           plan.prefix_ids, plan.suffix_ids, sampling, plan.kv_salt(salt), **extra)
                while True:
                    try:
                        ev = await self._before(deadline, "decode", gen.__anext__())
                    except StopAsyncIteration:
                        break
                    except DeadlineExceeded:
                        if extra:
                            await self.backends.cancel(di, tid)
                        raise
                    if isinstance(ev, TokenEvent):
                        if ttft is None:               # observed below, labelled with what executed
                            ttft = time.perf_counter() - t0
                        sent += 1
                        yield ev
                    else:
                        summary = ev
                fallbacks += list(summary.fallbacks)
                break
            except WorkerLost as exc:
                tried[exc.role].add(exc.index)
                if sent == 0 and attempt < self.fault.retries:
                    attempt += 1
                    m.retries.labels(exc.role, "lost_before_first_token").inc()
                    log.warning("request %s: %s before its first token; retrying on another worker (%d/%d)",
                                plan.request_id, exc, attempt, self.fault.retries)
                    continue
                reason = "lost_mid_stream" if sent else "retries_exhausted"
                m.retries.labels(exc.role, reason).inc()
                m.count_request(kind, "worker_lost")
                log.error("request %s failed: %s (%s after %d tokens)", plan.request_id, exc, reason, sent)
                if sent:
                    raise WorkerLost(exc.role, exc.index, f"{exc.reason} mid-stream after {sent} tokens; the answer "
                                     "is incomplete, send the request again") from None
                raise RequestError(503, f"{exc}; retried {attempt} time(s) without success, send the request "
                                        "again", code="worker_lost") from None
            except DeadlineExceeded as exc:
                m.deadlines.labels(exc.stage).inc()
                m.count_request(kind, "deadline")
                log.warning("request %s: deadline passed during %s; worker told to stop", plan.request_id, exc.stage)
                raise RequestError(504, str(exc), code="deadline_exceeded") from None
            except RequestError:
                m.count_request(kind, "client_error")
                raise
            except Exception:
                m.count_request(kind, "error")
                raise
            finally:
                self.view.end("decode", di, sampling.max_tokens)

        if ttft is None:                           # no token at all (immediate EOS): TTFT is the whole call
            ttft = time.perf_counter() - t0
        # what executed: a fallback that recomputed the prefix (a missing chunk, a refused or lost
        # block) makes the request a recompute, whatever was planned
        executed = "recompute" if any(f not in STORE_ONLY_FALLBACKS for f in fallbacks) else kind
        m.ttft.labels(executed).observe(ttft)
        m.count_request(executed, "ok", fallbacks[0] if fallbacks else "")
        for f in fallbacks:
            m.record_fallback(f)
        cached = 0
        # prompt tokens the decode engine found in its own prefix cache (vLLM's APC) rather than
        # received: usage.cached_tokens counts them too (at least the larger of the two sources)
        engine_hit = max(summary.cached_tokens - summary.loaded_tokens, 0)
        if res is not None:
            st = res.stats
            recomputed_prefix = not res.transferred or bool(summary.fallbacks)
            if not recomputed_prefix:
                cached = st.reused + st.repositioned
            extra = max(engine_hit - cached, 0)
            m.prompt_tokens.labels("reused").inc(st.reused if not recomputed_prefix else 0)
            m.prompt_tokens.labels("repositioned").inc(st.repositioned if not recomputed_prefix else 0)
            m.prompt_tokens.labels("erratum").inc(st.erratum)
            m.prompt_tokens.labels("decode_cache").inc(extra)
            m.prompt_tokens.labels("computed").inc(max(plan.prompt_tokens - cached - extra - st.erratum, 0))
            m.tier_rewarms.inc(st.rewarmed)
            if res.transferred:
                m.transfer_bytes.labels(res.transport or "grpc").inc(res.transfer_bytes)
                m.transfer_seconds.labels(res.transport or "grpc").observe(res.transfer_seconds)
            cached += extra
        else:
            cached = min(engine_hit, plan.prompt_tokens)
            m.prompt_tokens.labels("decode_cache").inc(cached)
            m.prompt_tokens.labels("computed").inc(plan.prompt_tokens - cached)
        transport = res.transport if res is not None and res.transferred else ""
        got = {**(res.stats.stages if res is not None else {}), **dict(summary.stages)}
        stages = tuple((k, got[k]) for k in STAGES if k in got)
        for k, sec in stages:
            m.stage_seconds.labels(k, transport or "none").observe(sec)
        self.guard.after_response(plan, tenant or self.default_tenant, pi)   # shadow check: fire and forget
        yield Finished(plan, summary, ttft, plan.prompt_tokens, cached, tuple(fallbacks),
                       bool(res is not None and res.stored), stages, transport)

    @staticmethod
    async def _before(deadline: float, stage: str, aw):
        """Await ``aw`` until the deadline (perf_counter time); past it, DeadlineExceeded."""
        left = deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(aw, timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(stage) from None

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
