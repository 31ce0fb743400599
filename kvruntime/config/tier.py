"""The ``tier`` section: where prefill actors keep KV between requests (LMCache: CPU, local disk,
a shared remote tier server, a persistent fs:// tier), and how the store behaves. The one
``TierConfig``: the prefill actor hands it, as it is, to ``kvtransport.tier.lmcache_store.LMCacheStore``
(the ``lm://`` tier's key travels beside it, never in the config). Sizes in bytes, times in seconds.
Flat keys in a config file carry a ``tier_`` prefix (``tier_cpu_bytes`` -> ``tier.cpu_bytes``)."""
from __future__ import annotations

from dataclasses import dataclass

from kvruntime.config.choices import TierConnector

MIB = 1 << 20


@dataclass(frozen=True)
class TierConfig:
    cpu_bytes: int = 512 * MIB                 # LMCache's local CPU buffer (allocated at start); it also stages every
                                               # disk / fs / remote transfer, so it exists even with local_cpu off
    local_cpu: bool = True                     # keep chunks in that buffer (LRU-evicted by LMCache when full)
    disk_path: str | None = None               # local disk tier (LMCache local_disk; its index is in memory: not persistent)
    disk_bytes: int = 1 << 30                  # that tier's capacity (used only with disk_path)
    persist_dir: str | None = None             # LMCache fs:// tier: one file per piece, KV survives a restart of the whole cluster
    remote_url: str | None = None              # lm://host:port (`kvnotes tier-server`), shared by all prefill actors
    remote_capacity_bytes: int = 4 << 30       # the tier server's capacity: least recently used pieces are evicted beyond it
    remote_probe_s: float | None = 2.0         # each prefill actor probes the tier server this often (kvnotes_tier_remote_up;
                                               # None: only on operations)
    remote_timeout_s: float = 1.0              # bound on each remote round trip (probe, lookup, get, put)
    remote_retry_s: float = 5.0                # while the remote is down, an operation re-attaches at most this often
    confirm_timeout_s: float = 30.0            # put() waits this long for the asynchronous tiers to confirm
    chunk_size: int = 256                      # LMCache piece size (tokens): the prompt index records prefixes at its multiples
    connector: TierConnector = TierConnector.CPU  # where LMCache's connector keeps what it copies: cpu | cuda
    # TLS for lm:// (kvtransport.tier.tls: a local tunnel on each prefill actor, a terminator in the tier
    # server): on with remote_tls_ca_file, which both ends verify the other's certificate against; the server
    # presents remote_tls_cert_file / _key_file, and so do clients when remote_tls_client_auth (the default:
    # the same files on every host); remote_tls_server_name: the name the server's certificate carries when
    # it is not the URL's host
    remote_tls_ca_file: str | None = None
    remote_tls_cert_file: str | None = None
    remote_tls_key_file: str | None = None
    remote_tls_server_name: str | None = None
    remote_tls_client_auth: bool = True

    def __post_init__(self):
        for name in ("cpu_bytes", "disk_bytes", "remote_capacity_bytes", "chunk_size"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"tier_{name} must be an integer, got {getattr(self, name)!r}")
        if self.cpu_bytes < MIB:
            raise ValueError(f"tier_cpu_bytes must be >= 1 MiB (1048576): it stages every transfer, got {self.cpu_bytes}")
        if self.disk_path is not None and self.disk_bytes < MIB:
            raise ValueError(f"tier_disk_bytes must be >= 1 MiB (1048576) with tier_disk_path, got {self.disk_bytes}")
        if self.remote_capacity_bytes < MIB:
            raise ValueError("tier_remote_capacity_bytes must be an integer >= 1 MiB (1048576)")
        if self.remote_url is not None:
            parse_lm_url(self.remote_url)
        if self.remote_probe_s is not None and not 0 < self.remote_probe_s <= 3600:
            raise ValueError(f"tier_remote_probe_s must be in (0, 3600] or null, got {self.remote_probe_s}")
        if not (0 < self.remote_timeout_s <= 60 and self.remote_retry_s > 0 and self.confirm_timeout_s > 0):
            raise ValueError("tier_remote_timeout_s must be in (0, 60]; tier_remote_retry_s and "
                             "tier_confirm_timeout_s > 0")
        if self.chunk_size <= 0 or self.chunk_size % 16:
            raise ValueError(f"tier_chunk_size must be a positive multiple of 16, got {self.chunk_size}")
        object.__setattr__(self, "connector", TierConnector.of(self.connector))
        if not (self.local_cpu or self.disk_path or self.persist_dir or self.remote_url):
            raise ValueError("no tier would hold anything: enable tier_local_cpu or configure another tier")
        self._check_tls()

    def _check_tls(self) -> None:
        names = ("remote_tls_ca_file", "remote_tls_cert_file", "remote_tls_key_file", "remote_tls_server_name")
        for name in names:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip() or
                                  (name.endswith("server_name") and any(c.isspace() for c in v))):
                raise ValueError(f"tier_{name} must be a non-empty string or null, got {v!r}")
        if not isinstance(self.remote_tls_client_auth, bool):
            raise ValueError(f"tier_remote_tls_client_auth must be true or false, got {self.remote_tls_client_auth!r}")
        if any(getattr(self, n) for n in names) and not (self.remote_url and self.remote_tls_ca_file):
            raise ValueError("the tier_remote_tls_* settings need tier_remote_url and tier_remote_tls_ca_file "
                             "(TLS for lm:// is on with the CA both ends verify against)")
        if (self.remote_tls_cert_file is None) != (self.remote_tls_key_file is None):
            raise ValueError("tier_remote_tls_cert_file and tier_remote_tls_key_file go together")
        if self.remote_tls_ca_file and self.remote_tls_client_auth and not self.remote_tls_cert_file:
            raise ValueError("tier_remote_tls_client_auth needs tier_remote_tls_cert_file and _key_file (the "
                             "certificate every prefill actor presents; or tier_remote_tls_client_auth: false)")

    @property
    def remote_tls(self) -> "TierTLS | None":
        """The lm:// TLS settings, or None for plain TCP."""
        if not self.remote_tls_ca_file:
            return None
        return TierTLS(self.remote_tls_ca_file, self.remote_tls_cert_file, self.remote_tls_key_file,
                       self.remote_tls_server_name, self.remote_tls_client_auth)


@dataclass(frozen=True)
class TierTLS:
    """TLS for the lm:// tier (``TierConfig.remote_tls``; ``kvtransport.tier.tls`` reads the files)."""
    ca_file: str
    cert_file: str | None = None            # with key_file: this end's certificate (the server's; a client's)
    key_file: str | None = None
    server_name: str | None = None          # checked in the server's certificate (default: the URL's host)
    client_auth: bool = True                # the server requires a client certificate of the CA


def parse_lm_url(url: str) -> tuple[str, int]:
    """``"lm://host:port"`` -> (host, port); ``ValueError`` otherwise."""
    if not isinstance(url, str) or not url.startswith("lm://"):
        raise ValueError(f"tier_remote_url must look like 'lm://host:port', got {url!r}")
    host, sep, port = url[len("lm://"):].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"tier_remote_url must look like 'lm://host:port', got {url!r}")
    return host, int(port)
