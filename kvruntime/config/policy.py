"""The ``policy`` section: which KV policy a request gets by default and what ``balanced`` and
``fast`` must measure before the planner composes (``cluster.control.compose_choice``)."""
from __future__ import annotations

from dataclasses import dataclass

# kvruntime.messages.plan.Policy's values (the config sits below messages; tests/test_config.py checks they agree)
POLICIES = ("exact", "balanced", "fast")

# ``balanced``'s answer target, checked against a profile's ``compose_answers`` section: an operation
# is allowed when its accuracy drop vs recompute is at most drop_bound (one-sided 95% upper bound),
# its yes/no decision agreement with recompute >= decision, its top-1 agreement >= top1 and its
# recompute ratio r <= max_ratio. The defaults of the PolicyConfig fields below.
BALANCED_ANSWER_TARGET = dict(drop_bound=0.02, decision=0.98, top1=0.95, max_ratio=0.10)
BALANCED_MIN_CASES = dict(cases=30, answered=30, decisions=20)   # fewer measured: the op is not trusted


@dataclass(frozen=True)
class PolicyConfig:
    default_policy: str = "balanced"           # exact | balanced | fast
    seam_tokens: int = 1
    profiles_dir: str | None = None            # calibrated fidelity profiles (`kvnotes calibrate`); None: ~/.cache/kvnotes/profiles
    # balanced: the cheapest compose op whose `compose_answers` row (cluster.control.compose_choice.FidelityTarget.answers)
    # has top-1 agreement >= balanced_min_top1, accuracy drop vs recompute <= balanced_max_accuracy_drop
    # (one-sided 95% bound), decision agreement >= balanced_min_decision, r <= balanced_max_recompute_ratio,
    # measured on >= balanced_min_cases cases (and as many judged answers; decision cases: BALANCED_MIN_CASES)
    balanced_min_top1: float = BALANCED_ANSWER_TARGET["top1"]
    balanced_max_accuracy_drop: float = BALANCED_ANSWER_TARGET["drop_bound"]
    balanced_min_decision: float = BALANCED_ANSWER_TARGET["decision"]
    balanced_max_recompute_ratio: float = BALANCED_ANSWER_TARGET["max_ratio"]
    balanced_min_cases: int = BALANCED_MIN_CASES["cases"]
    fast_min_top1: float | None = None         # fast: None = reposition + seam_tokens without a target (next-token rows)
    # a plain prompt the decode engine computed itself (vLLM: cold, or after the prefix it held) is
    # compiled into the tier in the background by a prefill worker (cluster.control.store_behind), so
    # later prompts reuse and edit it; at most store_behind_in_flight at once per router replica, and
    # store_behind_queue waiting (a waiting store a newer prompt of the same tenant extends is
    # superseded; a full queue: store_behind_when_full "displace" drops the oldest waiting store of
    # the tenant holding the most, "skip" the new one; each counted in kvnotes_prompt_stores_total{outcome})
    store_behind: bool = True
    store_behind_in_flight: int = 1
    store_behind_queue: int = 4
    store_behind_when_full: str = "displace"
    # background compiles (store-behind, recurring spans, first-sighting units) yield to requests:
    # each waits until no request of its router replica has been in flight for background_quiet_s,
    # at most background_max_wait_s, then runs anyway (both counted in kvnotes_fallbacks_total
    # {reason="background_deferred"|"background_deferral_expired"}); background_quiet_s 0: off
    background_quiet_s: float = 0.5
    background_max_wait_s: float = 30.0

    def __post_init__(self):
        if self.default_policy not in POLICIES:
            raise ValueError(f"default_policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.default_policy!r}")
        if not isinstance(self.seam_tokens, int) or self.seam_tokens < 0:
            raise ValueError("seam_tokens must be an integer >= 0")
        for name in ("balanced_min_top1", "fast_min_top1", "balanced_max_accuracy_drop", "balanced_min_decision",
                     "balanced_max_recompute_ratio"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.store_behind_in_flight < 1 or self.store_behind_queue < 0:
            raise ValueError("store_behind_in_flight must be >= 1 and store_behind_queue >= 0")
        if self.store_behind_when_full not in ("displace", "skip"):
            raise ValueError(f"store_behind_when_full must be displace or skip, got {self.store_behind_when_full!r}")
        if not (self.background_quiet_s >= 0 and self.background_max_wait_s >= 0):
            raise ValueError(f"background_quiet_s and background_max_wait_s must be >= 0, got "
                             f"{self.background_quiet_s!r}, {self.background_max_wait_s!r}")
        if not isinstance(self.balanced_min_cases, int) or self.balanced_min_cases < 1:
            raise ValueError(f"balanced_min_cases must be an integer >= 1, got {self.balanced_min_cases!r}")
