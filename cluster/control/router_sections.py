"""The typed sections a :class:`~cluster.control.router.Router` is built from (one per concern,
instead of a long keyword list): what model it serves, the request limits, and the planning
policy. Built by ``cluster.control.assembly`` from a ``ClusterConfig``; tests build them directly."""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.control.backends import YieldConfig
from cluster.control.compose_choice import FidelityTarget
from cluster.control.matching import MatchConfig
from cluster.control.store_behind import StoreBehindConfig
from kvruntime.config.shadow import ShadowConfig
from kvruntime.config.workers import WorkersConfig


@dataclass(frozen=True)
class ModelSection:
    """The weights the workers run and the name clients use."""
    model_id: str                     # = the engines' model_id (KV keys and plans carry it)
    dtype: str                        # the KV's dtype, checked on every transfer grant
    served_model: str | None = None   # the API's ``model``; None: the renderer's spec name


@dataclass(frozen=True)
class LimitsSection:
    """Request limits: tokens, the default tenant."""
    context_window: int = 8192        # tokens, prompt plus max_tokens
    max_tokens_limit: int = 2048      # the largest max_tokens a request may ask for
    default_tenant: str = "default"


@dataclass(frozen=True)
class PolicySection:
    """How requests are planned: the default policy, fidelity targets and shadow checks."""
    default_policy: str = "balanced"
    seam_tokens: int = 1
    fidelity_summary: dict | None = None     # the model's measured fidelity profile (None: uncalibrated)
    balanced_min_top1: float = 0.95
    balanced_target: FidelityTarget | None = None
    fast_min_top1: float | None = None
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    decode_computes_cold: bool = False       # vLLM: a prompt reusing nothing runs no prefill
    matching: MatchConfig = field(default_factory=MatchConfig)   # plain prompts matched past their exact prefix
    store_behind: StoreBehindConfig = field(default_factory=StoreBehindConfig)  # decode-computed prompts into the tier
    decode_tail: int = WorkersConfig.vllm_decode_tail   # vLLM computes a composed prompt's unheld tail (lifecycle)
    background_yield: YieldConfig = field(default_factory=YieldConfig)   # background compiles (store-behind, recurring spans/units) let requests go first
