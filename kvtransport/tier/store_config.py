"""Which tiers an :class:`~kvtransport.tier.lmcache_store.LMCacheStore` uses, checked when built
(one ``ValueError`` naming the field). The prefill actor builds it from the cluster config's
``tier`` section (``kvruntime.config.tier``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierConfig:
    """Which tiers an :class:`LMCacheStore` uses. Sizes in GiB, times in seconds."""
    local_cpu: bool = True             # keep chunks in local CPU memory (LRU-evicted by LMCache when full)
    local_cpu_gb: float = 1.0          # local CPU buffer size; also stages disk/fs/remote transfers
    local_disk_dir: str | None = None  # LMCache local disk tier (not persistent: in-memory index)
    local_disk_gb: float = 0.0         # its capacity; > 0 when local_disk_dir is set
    persist_dir: str | None = None     # fs:// tier directory: one file per 256-token piece, survives restarts
    remote_url: str | None = None      # "lm://host:port" of a kvnotes tier server (kvtransport.tier.server)
    # its 32-byte key: kvtransport.tier.auth.tier_key(cluster secret); required with remote_url
    remote_key: bytes | None = field(default=None, repr=False)
    remote_timeout_s: float = 1.0      # bound on each remote round trip (probe, lookup, get, put)
    remote_retry_s: float = 5.0        # while the remote is down, an operation re-attaches at most this often
    remote_probe_s: float | None = 2.0  # probe the server this often, traffic or not (None: only on operations)
    confirm_timeout_s: float = 30.0    # put() waits this long for async tiers to confirm
    chunk_size: int = 256              # LMCache piece size (tokens)
    connector: str = "cpu"             # "cpu" | "cuda" (see lmcache_connector.make_connector)

    def __post_init__(self) -> None:
        if self.local_cpu_gb <= 0:
            raise ValueError(f"local_cpu_gb must be > 0 (it stages every transfer), got {self.local_cpu_gb}")
        if (self.local_disk_dir is None) != (self.local_disk_gb <= 0):
            raise ValueError("set local_disk_dir and local_disk_gb > 0 together, or neither")
        if self.remote_url is not None:
            from kvtransport.tier.lmcache_remote import parse_lm_url
            parse_lm_url(self.remote_url)
            from kvtransport.tier.auth import check_key
            if self.remote_key is None:
                raise ValueError("remote_url needs remote_key: the tier server refuses anonymous clients "
                                 "(kvtransport.tier.auth.tier_key of the cluster secret)")
            check_key(self.remote_key)
        if self.remote_probe_s is not None and not 0 < self.remote_probe_s <= 3600:
            raise ValueError(f"remote_probe_s must be in (0, 3600] or None, got {self.remote_probe_s}")
        if not (0 < self.remote_timeout_s <= 60 and 0 < self.remote_retry_s and 0 < self.confirm_timeout_s):
            raise ValueError("remote_timeout_s must be in (0, 60]; remote_retry_s and confirm_timeout_s > 0")
        if self.chunk_size <= 0 or self.chunk_size % 16:
            raise ValueError(f"chunk_size must be a positive multiple of 16, got {self.chunk_size}")
        if self.connector not in ("cpu", "cuda"):
            raise ValueError(f"connector must be 'cpu' or 'cuda', got {self.connector!r}")
        if not (self.local_cpu or self.local_disk_dir or self.persist_dir or self.remote_url):
            raise ValueError("no tier would hold anything: enable local_cpu or configure another tier")
