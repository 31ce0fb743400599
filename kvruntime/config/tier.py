"""The ``tier`` section: where prefill actors keep KV between requests (LMCache: CPU, local disk,
a shared remote tier server, a persistent fs:// tier). Flat keys in a config file carry a
``tier_`` prefix (``tier_cpu_bytes`` -> ``tier.cpu_bytes``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierConfig:
    cpu_bytes: int = 512 << 20                 # local CPU tier capacity (LMCache; allocated at start)
    disk_path: str | None = None               # local disk tier (LMCache local_disk)
    remote_url: str | None = None              # lm://host:port (`kvnotes tier-server`), shared by all prefill actors
    remote_capacity_bytes: int = 4 << 30       # the tier server's capacity: least recently used pieces are evicted beyond it
    remote_probe_s: float = 2.0                # each prefill actor probes the tier server this often (kvnotes_tier_remote_up)
    persist_dir: str | None = None             # LMCache fs:// tier: KV survives a restart of the whole cluster

    def __post_init__(self):
        if not isinstance(self.remote_capacity_bytes, int) or self.remote_capacity_bytes < 1 << 20:
            raise ValueError("tier_remote_capacity_bytes must be an integer >= 1 MiB (1048576)")
        if not 0 < self.remote_probe_s <= 60:
            raise ValueError(f"tier_remote_probe_s must be in (0, 60], got {self.remote_probe_s}")
