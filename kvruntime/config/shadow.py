"""The ``shadow`` section: online shadow checks (``cluster.control.shadow``) recompute a sample of
approximate and frame-variant requests after the response and demote an operation that drifts.
Flat keys in a config file carry a ``shadow_`` prefix (``shadow_fraction`` -> ``shadow.fraction``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShadowConfig:
    fraction: float = 0.01                     # share of approximate and frame-variant (reuse(frame)) requests checked (0 = off)
    opt_out_tenants: tuple[str, ...] = ()      # tenants never checked
    max_in_flight: int = 2                     # checks pending at once; more are dropped (counted)
    window: int = 50                           # results per operation in the agreement window
    min_samples: int = 20                      # no demotion before this many results
    demote_s: float = 600.0                    # a demoted operation is retried (on probation) after this

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("shadow_fraction must be in [0, 1]")
        if not isinstance(self.opt_out_tenants, (list, tuple)) or \
                not all(isinstance(t, str) for t in self.opt_out_tenants):
            raise ValueError("shadow_opt_out_tenants must be a list of tenant names")
        object.__setattr__(self, "opt_out_tenants", tuple(self.opt_out_tenants))
        if self.max_in_flight < 1 or not 1 <= self.min_samples <= self.window or self.demote_s <= 0:
            raise ValueError("shadow_max_in_flight >= 1, 1 <= shadow_min_samples <= shadow_window and "
                             "shadow_demote_s > 0 required")
