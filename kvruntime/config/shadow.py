"""The ``shadow`` section: online shadow checks (``cluster.control.shadow``) recompute a sample of
approximate and frame-variant requests after the response and demote an operation that drifts.
Flat keys in a config file carry a ``shadow_`` prefix (``shadow_fraction`` -> ``shadow.fraction``).
The one ``ShadowConfig``: the router's monitor receives this value as it is."""
from __future__ import annotations

from dataclasses import dataclass

from kvruntime.config.choices import ShadowMetric


@dataclass(frozen=True)
class ShadowConfig:
    fraction: float = 0.01                     # share of approximate and frame-variant (reuse(frame)) requests checked (0 = off)
    opt_out_tenants: tuple[str, ...] = ()      # tenants never checked (a list, tuple or set of names; kept as a sorted tuple)
    max_in_flight: int = 2                     # checks running or queued at once; more are dropped (counted)
    window: int = 50                           # results per operation in the agreement window
    min_samples: int = 20                      # no demotion before this many results
    demote_s: float = 600.0                    # a demoted operation is retried (on probation) after this
    metric: ShadowMetric = ShadowMetric.TOP1   # the agreement compared with the operation's target

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"shadow_fraction must be in [0, 1], got {self.fraction!r}")
        tenants = self.opt_out_tenants
        if isinstance(tenants, str) or not isinstance(tenants, (list, tuple, set, frozenset)) or \
                not all(isinstance(t, str) for t in tenants):
            raise ValueError("shadow_opt_out_tenants must be a list of tenant names")
        object.__setattr__(self, "opt_out_tenants", tuple(sorted(set(tenants))))
        for name in ("max_in_flight", "window", "min_samples"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"shadow_{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_in_flight < 1 or not 1 <= self.min_samples <= self.window or not self.demote_s > 0:
            raise ValueError("shadow_max_in_flight >= 1, 1 <= shadow_min_samples <= shadow_window and "
                             "shadow_demote_s > 0 required")
        object.__setattr__(self, "metric", ShadowMetric.of(self.metric))
