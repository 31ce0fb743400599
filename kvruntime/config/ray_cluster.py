"""The ``ray`` section: which Ray cluster kvnotes runs on and how it is started. Flat keys in a
config file carry a ``ray_`` prefix (``ray_address`` -> ``ray.address``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None                 # None: start/attach local Ray; "auto" or host:port: join a cluster
    auth_mode: str | None = None               # token | disabled; None: token if ~/.ray/auth_token exists (Ray 2.60)
    start_attempts: int = 2                    # a local Ray whose raylet does not come up is shut down and started again, logged
    worker_niceness: int = 0                   # a local Ray kvnotes starts: its worker processes' niceness (Ray's own default
                                               # 15); the model workers lower theirs to workers.model_niceness (kvruntime.cpu_priority)

    def __post_init__(self):
        if self.auth_mode not in (None, "token", "disabled"):
            raise ValueError("ray_auth_mode must be token or disabled (or unset: token when ~/.ray/auth_token exists)")
        if not isinstance(self.start_attempts, int) or self.start_attempts < 1:
            raise ValueError("ray_start_attempts must be >= 1")
        if not isinstance(self.worker_niceness, int) or not 0 <= self.worker_niceness <= 19:
            raise ValueError("ray_worker_niceness must be an integer from 0 to 19")
