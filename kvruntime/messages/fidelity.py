"""Online shadow check results: a prefill worker recomputed an approximate request in full and
compared (first-token distribution, greedy continuation). Crosses the actor -> router boundary."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShadowResult:
    request_id: str
    kl: float                  # KL(P_recompute || P_plan) of the first token, nats
    top1: float                # 1.0 if the first token's argmax agrees
    greedy_exact: float        # 1.0 if the greedy-N continuations are identical
    greedy_prefix: float       # common-prefix fraction of the greedy-N continuations
    cosine: float = 1.0        # logit cosine (reported, but it does not discriminate; read KL)
    seconds: float = 0.0       # worker time spent on the check
