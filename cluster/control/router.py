"""The router: render -> plan -> prefill (on a prefill worker) -> decode (streamed from a
decode worker), recording every measurement in :class:`~cluster.control.metrics.Metrics`.

Stateless: registrations, templates, sessions, the prompt-prefix index and the cluster secret
live in the state store (``cluster.control.state``); any number of replicas serve the same cluster and a
restarted one loses nothing. It talks to workers only through :class:`~cluster.control.backends.Backends` (Ray actor
handles in production, see ``cluster.control.ray_backends``). Split by concern, this class wires
them and is the API layer's one handle:

- :mod:`cluster.control.registration`: skills and memories registered, listed, deleted;
- :mod:`cluster.control.prompt_index`: which stored prompt prefixes a request can reuse;
- :mod:`cluster.control.streaming`: a request rendered, planned and streamed;
- :mod:`cluster.control.lifecycle`: each plan executed (prefill, push, decode, retry, deadline, accounting).

Nothing here knows about Ray. KV is named by content (:class:`KVRef`): any prefill worker finds
what its tiers hold without a name map. Built from typed sections (:mod:`cluster.control.router_sections`).
"""
from __future__ import annotations

from typing import AsyncIterator

from cluster.control.backends import Backends, RequestActivity, YieldingBackends
from cluster.control.lifecycle import Finished, RequestRunner
from cluster.control.metrics import Metrics
from cluster.control.planner import FidelityTarget, PlannerConfig, choose_edit_kind, choose_edits_by_answers
from cluster.control.pricing import TokenBudget
from cluster.control.prompt_index import PromptIndex
from cluster.control.prompt_match import PromptMatcher
from cluster.control.registration import Registrations
from cluster.control.registry import Registry
from cluster.control.render import Renderer
from cluster.control.router_sections import LimitsSection, ModelSection, PolicySection
from cluster.control.routing import FaultPolicy, WorkerView
from cluster.control.sessions import SessionStore
from cluster.control.shadow import FidelityGuard
from cluster.control.state import StateStore
from cluster.control.streaming import RequestStreams
from cluster.control.tier_lookup import TierLookup
from cluster.control.usage_marks import UsageMarks
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.keys import tenant_salt
from kvruntime.messages.plan import Policy


class Router:
    def __init__(self, backends: Backends, renderer: Renderer, state: StateStore, model: ModelSection, *,
                 metrics: Metrics | None = None, policy: PolicySection | None = None,
                 limits: LimitsSection | None = None):
        policy, limits = policy or PolicySection(), limits or LimitsSection()
        self.backends, self.renderer, self.state = backends, renderer, state
        self.served_model = model.served_model or renderer.spec.name     # the API's `model` (clients send and see)
        self.model_id, self.dtype = model.model_id, model.dtype
        self.registry: Registry = renderer.registry
        self.metrics = metrics or Metrics()
        self.limits = limits
        self.default_policy = Policy(policy.default_policy)
        self.guard = self._guard(policy)
        self._secret = state.secret()          # the same for every replica: keys agree cluster-wide
        self.view: WorkerView = backends.view
        self.fault: FaultPolicy = backends.fault_policy
        self.runner = RequestRunner(backends, self.view, self.fault, self.metrics, model.dtype, self.guard,
                                    limits.default_tenant, policy.decode_tail)
        self.lookup = TierLookup(backends, self.metrics)
        self.prompt_index = PromptIndex(state, self.metrics, self.lookup)
        # one gate for every background compile (store-behind, recurring spans): this replica's requests first
        self.background = YieldingBackends(backends, RequestActivity(), policy.background_yield, self.metrics)
        self.matcher = PromptMatcher(state, backends, self.metrics, self.lookup, renderer.chunk_position,
                                     policy.matching, decode=lambda ids: renderer.tok.decode(ids),
                                     background=self.background)
        self.registrations = Registrations(backends, renderer, self.metrics, self.lookup, limits, self.salt)
        self.streams = RequestStreams(renderer, self.view, self.metrics, self.runner, self.lookup, self.prompt_index,
                                      SessionStore(state), UsageMarks(state, self.metrics), limits,
                                      self.default_policy, self.salt, lambda: self.planner_config, self.matcher,
                                      policy.store_behind, self.background)
        backends.start_health(self.metrics)

    def _guard(self, policy: PolicySection) -> FidelityGuard:
        """Fidelity targets per policy and the shadow checks that keep each compose op honest."""
        targets = {Policy.BALANCED: policy.balanced_target or FidelityTarget.answers(min_top1=policy.balanced_min_top1)}
        self.edit_choice = choose_edit_kind(policy.fidelity_summary, min_top1=targets[Policy.BALANCED].minimum)
        if policy.fast_min_top1 is not None:
            targets[Policy.FAST] = FidelityTarget("top1", policy.fast_min_top1)
        return FidelityGuard(policy.fidelity_summary, targets, policy.shadow, self.metrics,
                             lambda i, plan: self.backends.shadow(i, plan),
                             PlannerConfig(seam_tokens=policy.seam_tokens, edit=self.edit_choice,
                                           decode_computes_cold=policy.decode_computes_cold,
                                           balanced_edits=choose_edits_by_answers(
                                               policy.fidelity_summary, targets[Policy.BALANCED],
                                               model=self.renderer.spec.name)))

    @property
    def planner_config(self) -> PlannerConfig:
        return self.guard.planner_config()           # re-chosen when shadow checks demote/readmit an op

    @property
    def fidelity(self) -> dict:
        """Targets, each policy's compose op and why, shadow-check windows and demotions."""
        return self.guard.snapshot()

    @property
    def context_window(self) -> int:
        return self.limits.context_window

    @property
    def default_tenant(self) -> str:
        return self.limits.default_tenant

    def salt(self, tenant: str) -> str:
        return tenant_salt(tenant, self._secret)

    # ---- registration (cluster.control.registration) ----------------------------------------------
    async def register_chunk(self, kind: str, tenant: str, name: str, text: str) -> dict:
        out = await self.registrations.register_chunk(kind, tenant, name, text)
        reg = self.state.get_registration(tenant, kind, name)
        if reg is not None:              # found in any prompt at any offset from now on (prompt matching)
            await self.matcher.index_registration(tenant, kind, name, reg.token_ids, self.salt(tenant),
                                                  self.view.pick_prefill(None) if self.view.live("prefill") else 0)
        return out

    async def delete_chunk(self, kind: str, tenant: str, name: str) -> dict:
        reg = self.state.get_registration(tenant, kind, name)
        out = await self.registrations.delete_chunk(kind, tenant, name)
        if reg is not None:
            self.matcher.unindex_chunk(tenant, reg.token_ids)
        return out

    async def listing(self, kind: str, tenant: str) -> list[dict]:
        return await self.registrations.listing(kind, tenant)

    # ---- requests (cluster.control.streaming) ------------------------------------------------------
    def budget(self, sampling: SamplingParams) -> TokenBudget:
        return self.streams.budget(sampling)

    def stream_native(self, *a, **kw) -> AsyncIterator[TokenEvent | Finished]:
        return self.streams.stream_native(*a, **kw)

    def stream_prompt(self, *a, **kw) -> AsyncIterator[TokenEvent | Finished]:
        return self.streams.stream_prompt(*a, **kw)
