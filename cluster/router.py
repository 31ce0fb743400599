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

import hashlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol

from cluster.errors import RequestError
from cluster.metrics import Metrics
from cluster.planner import (FidelityTarget, PlannerConfig, RenderedRequest, SessionContext, TierView, choose_edit_kind,
                             plan_request)
from cluster.shadow import FidelityGuard, ShadowConfig
from cluster.registry import Registry
from cluster.render import Renderer
from cluster.sessions import SessionStore
from cluster.state import Registration, StateStore
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.messages.keys import tenant_salt, token_hash
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan
from kvruntime.messages.prefill import PrecompileInfo, PrefillResult

log = logging.getLogger(__name__)
# Plain-prompt prefix reuse granularity (tokens). Equal to the tier's LMCache piece size
# (kvtransport.lmcache_store.TierConfig.chunk_size): a stored prompt serves every prefix of it that
# ends on a piece boundary, so the index records exactly those boundaries (and the whole prefix).
PROMPT_BLOCK = 256


class Backends(Protocol):
    num_prefill: int
    num_decode: int

    async def contains(self, refs: list[KVRef], index: int = 0) -> list[bool]: ...
    async def precompile(self, ref: KVRef, index: int = 0) -> PrecompileInfo: ...
    async def evict(self, ref: KVRef) -> bool: ...
    async def prefill(self, index: int, plan: RequestPlan, decode_index: int, transfer_id: str,
                      store_as: KVRef | None) -> PrefillResult: ...
    async def shadow(self, index: int, plan: RequestPlan): ...   # -> messages.fidelity.ShadowResult
    def decode(self, index: int, transfer_id: str | None, prefix: tuple[int, ...], suffix: tuple[int, ...],
               sampling: SamplingParams, salt: str) -> AsyncIterator[TokenEvent | DecodeSummary]: ...


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
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()

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
        ids = self.renderer.chunk_ids(text)
        if len(ids) + 16 > self.context_window:
            raise RequestError(400, f"{kind} is {len(ids)} tokens; the model's window is {self.context_window}")
        ref = self.renderer.chunk_ref(ids, self.salt(tenant))
        info = await self.backends.precompile(ref, next(self._rr_prefill) % self.backends.num_prefill)
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
        got = await self.backends.contains(refs, index)
        self.metrics.tier_lookups.labels("lmcache").inc(len(refs))
        self.metrics.tier_hits.labels("lmcache").inc(sum(got))
        return {r.digest for r, ok in zip(refs, got) if ok}

    async def stream_native(self, tenant: str, segments: list[dict], *, policy: str | None, session: str | None,
                            sampling: SamplingParams, edit: str = "auto") -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        salt = self.salt(tenant)
        req = replace(self.renderer.render(rid, tenant, segments, Policy(policy or self.default_policy.value),
                                           session, salt), edit_strategy=edit)
        sess = self.sessions.get(tenant, session) if session else None
        pi = self._pick_prefill(f"{tenant}|{session}" if session else None)
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
        async for ev in self._run(plan, sampling, t0, store_as, pi, salt, tenant):
            if isinstance(ev, Finished) and session:
                self._remember(tenant, req, sess, plan, store_as if ev.stored else None)
            yield ev

    async def stream_prompt(self, tenant: str, prompt_ids: list[int], *, policy: str | None,
                            sampling: SamplingParams) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        salt = self.salt(tenant)
        self._check_budget(len(prompt_ids), sampling)
        req = self.renderer.render_prompt(rid, prompt_ids, Policy(policy or self.default_policy.value))
        prefix = tuple(req.context[0].token_ids) if req.context else ()
        pi = self._pick_prefill(_h(tenant, prefix[:PROMPT_BLOCK]) if len(prefix) >= PROMPT_BLOCK else None)
        hit_kv, hit = await self._prompt_lookup(tenant, salt, prefix, pi)
        plan = plan_request(req, TierView(prompt_prefix_hit=hit, prompt_prefix_kv=hit_kv), None,
                            self.renderer.encode, self.planner_config)
        store_as = None
        if len(prefix) >= PROMPT_BLOCK and hit < len(prefix):
            store_as = KVRef(prefix, 0, salt)
        async for ev in self._run(plan, sampling, t0, store_as, pi, salt, tenant):
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
    def _pick_prefill(self, sticky: str | None) -> int:
        """Sessions and prompt prefixes stick to one prefill actor (its local tier holds their KV;
        with a shared tier any actor would find them)."""
        if sticky:
            return int(hashlib.sha256(sticky.encode()).hexdigest(), 16) % self.backends.num_prefill
        return next(self._rr_prefill) % self.backends.num_prefill

    async def _run(self, plan: RequestPlan, sampling: SamplingParams, t0: float,
                   store_as: KVRef | None, pi: int, salt: str, tenant: str | None = None
                   ) -> AsyncIterator[TokenEvent | Finished]:
        m = self.metrics
        kind = plan.kind.value
        di = next(self._rr_decode) % self.backends.num_decode
        tid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
        try:
            res = None
            if plan.steps:
                res = await self.backends.prefill(pi, plan, di, tid, store_as)
            ttft = None
            fallbacks = list(res.stats.fallbacks) if res else []
            async for ev in self.backends.decode(di, tid if res is not None and res.transferred else None,
                                                 plan.prefix_ids, plan.suffix_ids, sampling, plan.kv_salt(salt)):
                if isinstance(ev, TokenEvent):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                        m.ttft.labels(kind).observe(ttft)
                    yield ev
                else:
                    summary = ev
            fallbacks += list(summary.fallbacks)
        except RequestError:
            m.requests.labels(kind, "client_error").inc()
            raise
        except Exception:
            m.requests.labels(kind, "error").inc()
            raise
        if ttft is None:                           # no token at all (immediate EOS): TTFT is the whole call
            ttft = time.perf_counter() - t0
            m.ttft.labels(kind).observe(ttft)
        m.requests.labels(kind, "ok").inc()
        for f in fallbacks:
            m.record_fallback(f)
        cached = 0
        if res is not None:
            st = res.stats
            recomputed_prefix = not res.transferred or bool(summary.fallbacks)
            if not recomputed_prefix:
                cached = st.reused + st.repositioned
            m.prompt_tokens.labels("reused").inc(st.reused if not recomputed_prefix else 0)
            m.prompt_tokens.labels("repositioned").inc(st.repositioned if not recomputed_prefix else 0)
            m.prompt_tokens.labels("erratum").inc(st.erratum)
            m.prompt_tokens.labels("computed").inc(plan.prompt_tokens - cached - st.erratum)
            m.tier_rewarms.inc(st.rewarmed)
            if res.transferred:
                m.transfer_bytes.labels("grpc").inc(res.transfer_bytes)
                m.transfer_seconds.labels("grpc").observe(res.transfer_seconds)
        else:
            m.prompt_tokens.labels("computed").inc(plan.prompt_tokens)
        self.guard.after_response(plan, tenant or self.default_tenant, pi)   # shadow check: fire and forget
        yield Finished(plan, summary, ttft, plan.prompt_tokens, cached, tuple(fallbacks),
                       bool(res is not None and res.stored))

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
