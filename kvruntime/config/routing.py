"""The ``routing`` section: fault handling and routing in the router (``cluster.control.health``,
``cluster.control.routing``, ``cluster.control.migration``): health checks, retries, mid-stream
migration, prefill affinity and the default request deadline."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingConfig:
    health_period_s: float = 1.0               # each router replica calls health() on every worker this often
    health_timeout_s: float = 5.0              # a worker that does not answer within this is marked down
    request_retries: int = 1                   # retries elsewhere of a request whose worker died before its 1st token
    decode_migrations: int = 1                 # times one request may continue on another decode worker when its
                                               # own dies mid-stream (0: the stream ends with an error instead)
    prefill_load_factor: float = 1.0           # prefill affinity load cap: factor x mean in-flight requests per actor
    request_deadline_s: float = 600.0          # default per-request deadline (a request may ask for less: deadline_s)

    def __post_init__(self):
        if self.request_retries < 0:
            raise ValueError("request_retries must be >= 0")
        if not isinstance(self.decode_migrations, int) or not 0 <= self.decode_migrations <= 8:
            raise ValueError(f"decode_migrations must be an integer in 0..8, got {self.decode_migrations!r}")
        if self.health_period_s <= 0 or self.health_timeout_s <= 0 or self.prefill_load_factor < 1.0:
            raise ValueError("health_period_s, health_timeout_s > 0 and prefill_load_factor >= 1.0 required")
        if self.request_deadline_s <= 0:
            raise ValueError("request_deadline_s must be > 0")
