"""The router: render -> plan -> prefill (on a prefill worker) -> decode (streamed from a
decode worker), recording every measurement in :class:`~cluster.metrics.Metrics`.

It talks to workers only through :class:`Backends` (Ray actor handles in production, see
``cluster.ray_backends``), so this file holds the request lifecycle and nothing about Ray.
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
from kvruntime.messages.plan import PlanKind, Policy, RequestPlan
from cluster.planner import (PlannerConfig, RenderedRequest, SessionContext, TierView, choose_edit_kind,
                             plan_request)
from cluster.render import Chunk, Registry, Renderer, chunk_key
from cluster.sessions import SessionStore
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent

log = logging.getLogger(__name__)
PROMPT_BLOCK = 32   # plain-prompt prefix cache granularity (tokens)


class Backends(Protocol):
    num_prefill: int
    num_decode: int

    async def contains(self, keys: list[str], index: int = 0) -> set[str]: ...
    async def precompile(self, key: str, token_ids: tuple[int, ...], tenant: str) -> dict: ...
    async def evict(self, key: str) -> bool: ...
    async def prefill(self, index: int, plan: RequestPlan, decode_index: int, transfer_id: str,
                      store_as: str | None): ...
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


class Router:
    def __init__(self, backends: Backends, renderer: Renderer, model_id: str, dtype: str, *,
                 metrics: Metrics | None = None, default_policy: str = "balanced", seam_tokens: int = 1,
                 fidelity_summary: dict | None = None, context_window: int = 8192, max_tokens_limit: int = 2048,
                 default_tenant: str = "default"):
        self.backends, self.renderer, self.model_id, self.dtype = backends, renderer, model_id, dtype
        self.registry: Registry = renderer.registry
        self.metrics = metrics or Metrics()
        self.sessions = SessionStore()
        self.default_policy = Policy(default_policy)
        self.edit_choice = choose_edit_kind(fidelity_summary)
        self.planner_config = PlannerConfig(seam_tokens=seam_tokens, edit=self.edit_choice)
        self.context_window, self.max_tokens_limit = context_window, max_tokens_limit
        self.default_tenant = default_tenant
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()
        self._prompt_index: dict[str, tuple[str, int]] = {}   # hash(prefix[:b]) -> (tier key, b)

    # ---- registration ---------------------------------------------------------------------
    async def register_chunk(self, kind: str, tenant: str, name: str, text: str) -> dict:
        if not isinstance(text, str) or not text.strip():
            raise RequestError(400, f"{kind} text must be a non-empty string", param="text")
        ids = self.renderer.chunk_ids(text)
        if len(ids) + 16 > self.context_window:
            raise RequestError(400, f"{kind} is {len(ids)} tokens; the model's window is {self.context_window}")
        key = chunk_key(self.model_id, self.dtype, tenant, ids)
        info = await self.backends.precompile(key, ids, tenant)
        self.registry.add_chunk(Chunk(kind, name, tenant, text, ids, key))
        return {"name": name, "kind": kind, "tokens": len(ids), "key": key, **info}

    async def delete_chunk(self, kind: str, tenant: str, name: str) -> dict:
        c = self.registry.remove_chunk(tenant, kind, name)
        shared = any(o.key == c.key for k in ("skill", "memory") for o in self.registry.chunks(tenant, k))
        evicted = False if shared else await self.backends.evict(c.key)
        return {"name": name, "kind": kind, "deleted": True, "evicted": evicted}

    # ---- requests ---------------------------------------------------------------------------
    def _check_budget(self, prompt_tokens: int, sampling: SamplingParams) -> None:
        if sampling.max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"max_tokens {sampling.max_tokens} exceeds this server's limit "
                                    f"{self.max_tokens_limit}", param="max_tokens")
        if prompt_tokens + sampling.max_tokens > self.context_window:
            raise RequestError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                                    f"the model's context window of {self.context_window} tokens",
                               code="context_length_exceeded")

    async def stream_native(self, tenant: str, segments: list[dict], *, policy: str | None, session: str | None,
                            sampling: SamplingParams, edit: str = "auto") -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        req = replace(self.renderer.render(rid, tenant, segments, Policy(policy or self.default_policy.value), session),
                      edit_strategy=edit)
        sess = self.sessions.get(tenant, session) if session else None
        pi = self._pick_prefill(session)
        keys = [s.chunk_key for s in req.context if s.chunk_key] + ([sess.context_key] if sess else [])
        present = await self.backends.contains(keys, pi) if keys else set()
        if sess is not None and sess.context_key not in present:
            self.metrics.record_fallback("session_context_evicted")
            log.warning("session %s: cached context no longer in the tier; planning from scratch", session)
            sess = None
        plan = plan_request(req, TierView(frozenset(present)), sess, self.renderer.encode, self.planner_config)
        self._check_budget(plan.prompt_tokens, sampling)
        store_as = None
        if session and not (len(plan.steps) == 1 and plan.steps[0].kind is PlanKind.REUSE):
            store_as = f"ctx-{hashlib.sha256(f'{tenant}|{session}|{rid}'.encode()).hexdigest()[:32]}"
        async for ev in self._run(plan, sampling, t0, store_as, pi, tenant):
            if isinstance(ev, Finished) and session:
                self._remember(tenant, req, sess, plan, store_as)
            yield ev

    async def stream_prompt(self, tenant: str, prompt_ids: list[int], *, policy: str | None,
                            sampling: SamplingParams) -> AsyncIterator[TokenEvent | Finished]:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        self._check_budget(len(prompt_ids), sampling)
        req = self.renderer.render_prompt(rid, prompt_ids, Policy(policy or self.default_policy.value))
        prefix = list(req.context[0].token_ids) if req.context else []
        pi = self._pick_prefill(self._h(tenant, prefix[:PROMPT_BLOCK]))
        hit_key, hit = self._prompt_lookup(tenant, prefix)
        if hit_key is not None and hit_key not in await self.backends.contains([hit_key], pi):
            hit_key, hit = None, 0
        plan = plan_request(req, TierView(prompt_prefix_hit=hit, prompt_prefix_key=hit_key), None,
                            self.renderer.encode, self.planner_config)
        store_as = None
        if len(prefix) >= PROMPT_BLOCK and hit < len(prefix):
            store_as = "prompt-" + self._h(tenant, prefix)
        async for ev in self._run(plan, sampling, t0, store_as, pi, tenant):
            if isinstance(ev, Finished) and store_as and "kv_transfer" not in " ".join(ev.fallbacks):
                self._prompt_register(tenant, prefix, store_as)
            yield ev

    # ---- lifecycle --------------------------------------------------------------------------
    def _pick_prefill(self, sticky: str | None) -> int:
        """Sessions and prompt prefixes stick to one prefill actor (its tier holds their KV)."""
        if sticky:
            return int(hashlib.sha256(sticky.encode()).hexdigest(), 16) % self.backends.num_prefill
        return next(self._rr_prefill) % self.backends.num_prefill

    async def _run(self, plan: RequestPlan, sampling: SamplingParams, t0: float,
                   store_as: str | None, pi: int, tenant: str) -> AsyncIterator[TokenEvent | Finished]:
        m = self.metrics
        kind = plan.kind.value
        di = next(self._rr_decode) % self.backends.num_decode
        tid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
        prefix_ids = tuple(t for s in plan.steps for t in s.token_ids)
        try:
            res = None
            if plan.steps:
                res = await self.backends.prefill(pi, plan, di, tid, store_as)
            ttft = None
            fallbacks = list(res.stats.fallbacks) if res else []
            async for ev in self.backends.decode(di, tid if res is not None and res.transferred else None,
                                                 prefix_ids, plan.suffix_ids, sampling, plan.kv_salt(tenant)):
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
            m.tier_lookups.labels("lmcache").inc(st.tier_lookups)
            m.tier_hits.labels("lmcache").inc(st.tier_hits)
            if res.transferred:
                m.transfer_bytes.labels("grpc").inc(res.transfer_bytes)
                m.transfer_seconds.labels("grpc").observe(res.transfer_seconds)
        else:
            m.prompt_tokens.labels("computed").inc(plan.prompt_tokens)
        yield Finished(plan, summary, ttft, plan.prompt_tokens, cached, tuple(fallbacks))

    def _remember(self, tenant: str, req: RenderedRequest, sess: SessionContext | None, plan: RequestPlan,
                  store_as: str | None) -> None:
        ctx_ids = tuple(t for s in plan.steps for t in s.token_ids)
        fields = tuple((s.name, s.fields) for s in req.context if s.kind == "template")
        kinds = {s.kind for s in plan.steps}
        if store_as is None and sess is not None:
            return                                             # reused unchanged: nothing to update
        if PlanKind.ERRATUM in kinds and sess is not None:
            self.sessions.put(tenant, replace(sess, context_key=store_as, token_ids=ctx_ids,
                                              current_fields=fields, errata=sess.errata + 1))
        else:
            self.sessions.put(tenant, SessionContext(req.session, store_as, req.context, ctx_ids, fields, 0))

    # ---- plain-prompt prefix index ------------------------------------------------------------
    @staticmethod
    def _h(tenant: str, ids) -> str:
        return hashlib.sha256((tenant + "|" + ",".join(map(str, ids))).encode()).hexdigest()[:32]

    def _prompt_lookup(self, tenant: str, prefix: list[int]) -> tuple[str | None, int]:
        for b in sorted({*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)}, reverse=True):
            if b <= 0:
                continue
            hit = self._prompt_index.get(self._h(tenant, prefix[:b]))
            if hit is not None:
                return hit[0], b
        return None, 0

    def _prompt_register(self, tenant: str, prefix: list[int], key: str) -> None:
        for b in {*range(PROMPT_BLOCK, len(prefix) + 1, PROMPT_BLOCK), len(prefix)}:
            self._prompt_index[self._h(tenant, prefix[:b])] = (key, b)
