"""Typed configuration, in one place. ``kvnotes serve --config FILE`` reads YAML or JSON into
:class:`ClusterConfig`; unknown keys and bad values are ``ValueError`` with the key named.
Every process (router replicas, prefill and decode actors) receives the same frozen value."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class WorkerConfig:
    count: int = 1                     # actors of this kind
    num_cpus: float = 1.0              # Ray CPUs reserved per actor
    num_gpus: float = 0.0              # Ray GPUs per actor (device becomes cuda when > 0)
    custom_resource: bool = False      # also require {"prefill": 1} / {"decode": 1} (pin to node types)
    threads: int = 1                   # torch threads inside the actor

    def validate(self, kind: str) -> None:
        if self.count < 1:
            raise ValueError(f"{kind}.count must be >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.threads < 1:
            raise ValueError(f"{kind}: num_cpus/num_gpus must be >= 0 and threads >= 1")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"                     # reference engine dtype
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    decode_engine: str = "reference"           # reference (torch oracle) | vllm (vLLM v1 + kvnotes KV connector)
    vllm_kv_cache_gib: float = 1.0             # engine=vllm: paged KV space per decode actor (GiB; CPU: VLLM_CPU_KVCACHE_SPACE)
    vllm_max_model_len: int = 8192             # engine=vllm: longest prompt + completion (tokens)
    vllm_max_concurrency: int = 16             # engine=vllm: requests one decode actor accepts at once (batched by vLLM)
    default_policy: str = "balanced"           # exact | balanced | fast
    seam_tokens: int = 1
    kv_load_failure_policy: str = "recompute"  # recompute | fail
    transfer_timeout_s: float = 30.0
    max_tokens_limit: int = 2048               # largest max_tokens a request may ask for
    tier_cpu_bytes: int = 512 << 20            # local CPU tier capacity (LMCache; allocated at start)
    tier_disk_path: str | None = None          # local disk tier (LMCache local_disk)
    tier_remote_url: str | None = None         # lm://host:port (lmcache_server), shared by all prefill actors
    tier_persist_dir: str | None = None        # LMCache fs:// tier: KV survives a restart of the whole cluster
    # state that survives (registrations, templates, sessions, prompt index, cluster secret)
    state_url: str | None = None               # None: sqlite:///<data_dir>/state.db; or sqlite:///PATH, redis://HOST:PORT/DB
    data_dir: str = "~/.local/share/kvnotes"   # default home of the SQLite state file
    router_replicas: int = 1                   # stateless Serve router replicas (all read the state store)
    session_ttl_s: float = 86400.0             # a session unused this long is forgotten
    session_max: int = 100_000                 # and at most this many are kept (least recently used go first)
    prompt_index_ttl_s: float = 3600.0         # plain-prompt prefix index entries expire after this
    prompt_index_max: int = 200_000            # and at most this many block hashes are kept (LRU)
    tenant: str = "default"                    # tenant salt used when a request names none
    ray_address: str | None = None             # None: start/attach local Ray; "auto" or host:port: join a cluster
    ray_auth_mode: str | None = None           # token | disabled; None: token if ~/.ray/auth_token exists (Ray 2.60)
    # fault handling and routing (cluster.health, cluster.routing)
    worker_max_restarts: int = 5               # Ray restarts a dead worker actor this often (-1: forever)
    health_period_s: float = 1.0               # each router replica calls health() on every worker this often
    health_timeout_s: float = 5.0              # a worker that does not answer within this is marked down
    request_retries: int = 1                   # retries elsewhere of a request whose worker died before its 1st token
    prefill_load_factor: float = 1.0           # prefill affinity load cap: factor x mean in-flight requests per actor
    request_deadline_s: float = 600.0          # default per-request deadline (a request may ask for less: deadline_s)
    start_timeout_s: float = 600.0             # start_workers gives up (naming the missing resources) after this

    def __post_init__(self):
        if self.default_policy not in ("exact", "balanced", "fast"):
            raise ValueError("default_policy must be exact, balanced or fast")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be recompute or fail")
        if self.decode_engine not in ("reference", "vllm"):
            raise ValueError("decode_engine must be reference or vllm")
        if self.vllm_kv_cache_gib <= 0 or self.vllm_max_model_len < 16 or self.vllm_max_concurrency < 1:
            raise ValueError("vllm_kv_cache_gib > 0, vllm_max_model_len >= 16 and vllm_max_concurrency >= 1 required")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError("dtype must be float32 or bfloat16")
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if self.seam_tokens < 0 or self.max_tokens_limit < 1 or self.transfer_timeout_s <= 0:
            raise ValueError("seam_tokens >= 0, max_tokens_limit >= 1 and transfer_timeout_s > 0 required")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.session_ttl_s <= 0 or self.prompt_index_ttl_s <= 0 or self.session_max < 1 or self.prompt_index_max < 1:
            raise ValueError("session_ttl_s, prompt_index_ttl_s > 0 and session_max, prompt_index_max >= 1 required")
        if self.state_url is not None and not self.state_url.startswith(("sqlite:///", "redis://")):
            raise ValueError(f"state_url must start with sqlite:/// or redis://, got {self.state_url!r}")
        if self.ray_auth_mode not in (None, "token", "disabled"):
            raise ValueError("ray_auth_mode must be token or disabled (or unset: token when ~/.ray/auth_token exists)")
        if self.worker_max_restarts < -1 or self.request_retries < 0:
            raise ValueError("worker_max_restarts must be >= -1 and request_retries >= 0")
        if self.health_period_s <= 0 or self.health_timeout_s <= 0 or self.prefill_load_factor < 1.0:
            raise ValueError("health_period_s, health_timeout_s > 0 and prefill_load_factor >= 1.0 required")
        if self.request_deadline_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("request_deadline_s and start_timeout_s must be > 0")
        self.prefill.validate("prefill")
        self.decode.validate("decode")

    @property
    def resolved_state_url(self) -> str:
        """``state_url``, or the SQLite file in ``data_dir`` (the embedded default)."""
        if self.state_url:
            return self.state_url
        return "sqlite:///" + str(Path(self.data_dir).expanduser() / "state.db")

    @staticmethod
    def from_dict(d: dict) -> "ClusterConfig":
        known = {f.name for f in dataclasses.fields(ClusterConfig)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(sorted(unknown))}")
        kw = dict(d)
        for k in ("prefill", "decode"):
            if k in kw:
                sub = kw[k]
                wk = {f.name for f in dataclasses.fields(WorkerConfig)}
                if not isinstance(sub, dict) or set(sub) - wk:
                    raise ValueError(f"{k} must be a mapping with keys among {sorted(wk)}")
                kw[k] = WorkerConfig(**sub)
        try:
            return ClusterConfig(**kw)
        except TypeError as exc:
            raise ValueError(f"bad config: {exc}") from None

    @staticmethod
    def from_file(path: str | Path) -> "ClusterConfig":
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config file {p} does not exist")
        text = p.read_text()
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping")
        return ClusterConfig.from_dict(data)
