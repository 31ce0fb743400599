"""The composition root of the control plane: a :class:`~cluster.control.router.Router` and its
collaborators (Ray backends, the state store, the renderer, the fidelity profile and targets,
the shadow checks, the store watch) built from one :class:`ClusterConfig`. The HTTP ingress
(``cluster.http.serve_app``) only calls :func:`assemble` and :func:`wire_admission` and serves
what they return; a script
or a test driving the router without HTTP calls it too (inside a Ray job whose workers are up).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvruntime.config import ClusterConfig

if TYPE_CHECKING:
    from cluster.control.admission import Admission
    from cluster.control.exchange import QueueExchange
    from cluster.control.ray_backends import RayBackends
    from cluster.control.router import Router
    from cluster.control.router_sections import LimitsSection, ModelSection, PolicySection
    from cluster.control.state import StateStore
    from cluster.control.state.watch import StoreWatch
    from kvruntime.fidelity.profiles import Profile

log = logging.getLogger(__name__)


@dataclass
class Assembly:
    """What :func:`assemble` built: the router and what the ingress serves beside it."""
    router: "Router"
    backends: "RayBackends"
    state: "StateStore"
    store_watch: "StoreWatch"
    profile: "Profile"
    served: str                 # the API's ``model`` (clients send and see it)


def assemble(cfg: ClusterConfig) -> Assembly:
    """Open the state store, find the named worker actors, load the tokenizer and the model's
    fidelity profile, and build the router over them (its health thread started). Imports no
    torch for a registry model (the router runs no model): the tokenizer comes from
    ``kvruntime.tokenizer`` (the class ``AutoTokenizer`` picks, loaded directly), the profile from
    the torch-free ``kvruntime.fidelity.profiles``."""
    from cluster.control.compose_choice import FidelityTarget
    from cluster.control.ray_backends import RayBackends
    from cluster.control.registry import Registry
    from cluster.control.render import Renderer
    from cluster.control.router import Router
    from cluster.control.router_sections import LimitsSection, ModelSection, PolicySection
    from cluster.control.state import configured_limits, open_state
    from cluster.control.state.watch import StoreWatch
    from cluster.control.backends import YieldConfig
    from cluster.control.store_behind import StoreBehindConfig
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.fidelity.profiles import find_profile
    from kvruntime.models import get_model_spec
    from kvruntime.tokenizer import load_tokenizer

    spec = get_model_spec(cfg.workers.model)
    ckpt = ensure_checkpoint(spec)
    tok = load_tokenizer(ckpt)
    # keyed by what the weights are (a checkpoint's content hash), not by the config's path
    profile = find_profile(spec, cfg.policy.profiles_dir)
    served = cfg.served_name(spec.name)      # the API's `model`; KV and profiles use spec.name
    backends = RayBackends.from_names(cfg)
    state = open_state(cfg.state.resolved_url, configured_limits(cfg))
    model = ModelSection(spec.name if spec.checkpoint else ckpt.name, cfg.workers.dtype,   # = engine.model_id
                         served_model=served)
    policy = PolicySection(default_policy=cfg.policy.default_policy, seam_tokens=cfg.policy.seam_tokens,
                           fidelity_summary=profile.summary, balanced_target=FidelityTarget.from_config(cfg),
                           fast_min_top1=cfg.policy.fast_min_top1,
                           shadow=cfg.shadow,      # the one ShadowConfig (kvruntime.config.shadow), as configured
                           # vLLM computes a prompt that reuses nothing itself: no prefill, no transfer
                           decode_computes_cold=cfg.workers.decode_engine == "vllm",
                           matching=cfg.matching,  # the one MatchConfig (kvruntime.config.matching), as configured
                           store_behind=StoreBehindConfig(cfg.policy.store_behind, cfg.policy.store_behind_in_flight,
                                                          cfg.policy.store_behind_queue, cfg.policy.store_behind_when_full),
                           background_yield=YieldConfig(cfg.policy.background_quiet_s, cfg.policy.background_max_wait_s),
                           decode_tail=cfg.workers.vllm_decode_tail)
    limits = LimitsSection(context_window=spec.context_window, max_tokens_limit=cfg.server.max_tokens_limit,
                           default_tenant=cfg.server.tenant)
    router = Router(backends, Renderer(tok, spec, Registry(state), tok.bos_token_id), state, model,
                    policy=policy, limits=limits)
    for info in backends.ready:
        router.metrics.rope_self_test.labels(info["worker"]).set(1 if info["rope_self_test_ok"] else 0)
    router.metrics.set_tenant_labels(cfg.server.metrics_tenants)
    watch = StoreWatch(state, router.metrics, cfg.state.probe_s)
    return Assembly(router, backends, state, watch, profile, served)


@dataclass
class AdmissionWiring:
    """One replica's admission queue and its exchange with the other replicas' queues."""
    admission: "Admission"
    exchange: "QueueExchange"


def wire_admission(cfg: ClusterConfig, router: "Router", process: str) -> AdmissionWiring:
    """This replica's admission (``cluster.control.admission``) over the router's backends: the
    backends learn the replica's name (``peers.me``) and report its queue with each prefill
    health probe (``queue_report``, ``cluster.control.peers``); a request about to be admitted is
    checked against the others' queues as they are now (``cluster.control.exchange``)."""
    from cluster.control.admission import Admission, AdmissionConfig
    from cluster.control.exchange import QueueExchange

    backends = router.backends
    backends.peers.me = process
    admission = Admission(AdmissionConfig.from_config(cfg), router.metrics,
                          workers=lambda: len(backends.view.live("prefill")), others=backends.peers.others,
                          reference=backends.peers.reference)
    exchange = QueueExchange(process, admission, backends, router.metrics, cfg.server.admission_exchange_timeout_s)
    backends.queue_report = exchange.report
    return AdmissionWiring(admission, exchange)
