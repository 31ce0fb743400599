"""Typed configuration, in one place. ``kvnotes serve --config FILE`` reads YAML or JSON into
:class:`ClusterConfig`; unknown keys and bad values are ``ValueError`` with the key named.
Every process (router replicas, prefill and decode actors) receives the same frozen value."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


# ``balanced``'s answer target (issue 24), checked against a profile's ``compose_answers`` section:
# an operation is allowed when its accuracy drop vs recompute is at most drop_bound (one-sided 95%
# upper bound), its yes/no decision agreement with recompute >= decision, its top-1 agreement
# >= top1 and its recompute ratio r <= max_ratio. The defaults of the ClusterConfig fields below.
BALANCED_ANSWER_TARGET = dict(drop_bound=0.02, decision=0.98, top1=0.95, max_ratio=0.10)
BALANCED_MIN_CASES = dict(cases=30, answered=30, decisions=20)   # fewer measured: the op is not trusted


@dataclass(frozen=True)
class WorkerConfig:
    count: int = 1                     # actors of this kind
    num_cpus: float = 1.0              # Ray CPUs reserved per actor
    num_gpus: float = 0.0              # Ray GPUs per actor (Ray hides GPUs from actors that reserve none)
    custom_resource: bool = False      # also require {"prefill": 1} / {"decode": 1} (pin to node types)
    threads: int = 1                   # torch threads inside the actor
    # the engine's device (kvruntime.device.resolve_device): auto = cuda when torch sees CUDA and Ray
    # assigned this actor a GPU, else cpu (logged); cuda = the assigned GPU or a clear error at start; cpu
    device: str = "auto"

    def validate(self, kind: str) -> None:
        if self.count < 1:
            raise ValueError(f"{kind}.count must be >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.threads < 1:
            raise ValueError(f"{kind}: num_cpus/num_gpus must be >= 0 and threads >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"{kind}.device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and self.num_gpus <= 0:
            raise ValueError(f"{kind}.device is cuda but {kind}.num_gpus is {self.num_gpus}: Ray gives an actor "
                             f"a GPU only when it reserves one (set {kind}.num_gpus, e.g. 1)")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "smollm2-135m"                # registry name, or a local HF checkpoint directory (kvruntime.hf_models)
    dtype: str = "float32"                     # reference engine weights and KV (tier, wire): float32 | bfloat16 | float16
    served_model_name: str | None = None       # the API's `model` (sent and shown); None: registry name, or the directory's name
    profiles_dir: str | None = None            # calibrated fidelity profiles (`kvnotes calibrate`); None: ~/.cache/kvnotes/profiles
    host: str = "127.0.0.1"
    port: int = 8000
    # kvnotes' own listeners (decode inboxes, metrics exporters): None = the address Ray runs on, or 127.0.0.1
    # for a one-node cluster serving a loopback host (launcher.listen_on_loopback); an IP: bound and advertised
    bind_host: str | None = None
    metrics_auth: bool = False                 # GET /metrics/targets (the map of internal endpoints) needs an API key
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    decode_engine: str = "reference"           # reference (torch oracle) | vllm (vLLM v1 + kvnotes KV connector)
    decode_prefix_cache_bytes: int = 256 << 20  # engine=reference: prefix KV a decode actor keeps (LRU) so it is not sent twice; 0 = off
    vllm_kv_cache_gib: float = 1.0             # engine=vllm: paged KV space per decode actor (GiB; CPU: VLLM_CPU_KVCACHE_SPACE)
    vllm_max_model_len: int = 8192             # engine=vllm: longest prompt + completion (tokens)
    vllm_max_concurrency: int = 16             # engine=vllm: requests one decode actor accepts at once (batched by vLLM)
    vllm_kv_load: str = "async"                # engine=vllm: async (running streams keep decoding while a block loads) | sync
    vllm_kv_load_threads: int = 2              # engine=vllm, async: blocks claimed, checked and written at once
    default_policy: str = "balanced"           # exact | balanced | fast
    seam_tokens: int = 1
    kv_load_failure_policy: str = "recompute"  # recompute | fail
    transfer_timeout_s: float = 30.0
    kv_transport: str = "auto"                 # auto (NIXL where it imports and starts, else gRPC) | nixl | grpc
    # transport tuning: a mapping of GrpcTransportConfig / NixlTransportConfig fields (kvtransport.transfer.options),
    # e.g. kv_grpc: {inbox_bytes: 8589934592}; checked by `kvnotes serve` before anything starts
    kv_grpc: tuple = ()
    kv_nixl: tuple = ()
    max_tokens_limit: int = 2048               # largest max_tokens a request may ask for
    tier_cpu_bytes: int = 512 << 20            # local CPU tier capacity (LMCache; allocated at start)
    tier_disk_path: str | None = None          # local disk tier (LMCache local_disk)
    tier_remote_url: str | None = None         # lm://host:port (`kvnotes tier-server`), shared by all prefill actors
    tier_remote_capacity_bytes: int = 4 << 30  # the tier server's capacity: least recently used pieces are evicted beyond it
    tier_remote_probe_s: float = 2.0           # each prefill actor probes the tier server this often (kvnotes_tier_remote_up)
    tier_persist_dir: str | None = None        # LMCache fs:// tier: KV survives a restart of the whole cluster
    # state that survives (registrations, templates, sessions, prompt index, cluster secret)
    # None: sqlite:///<data_dir>/state.db; or sqlite:///PATH, redis://[:PASSWORD@]HOST:PORT/DB, rediss://... (TLS);
    # in a config file ${VAR} is read from the environment (only here); kept out of repr (it may hold a password)
    state_url: str | None = field(default=None, repr=False)
    data_dir: str = "~/.local/share/kvnotes"   # default home of the SQLite state file
    router_replicas: int = 1                   # stateless Serve router replicas (all read the state store)
    session_ttl_s: float = 86400.0             # a session unused this long is forgotten
    session_max: int = 100_000                 # and at most this many are kept (least recently used go first)
    prompt_index_ttl_s: float = 3600.0         # plain-prompt prefix index entries expire after this
    prompt_index_max: int = 200_000            # and at most this many block hashes are kept (LRU)
    state_timeout_s: float = 2.0               # a Redis call without an answer within this fails: 503 state_store_unavailable
    state_probe_s: float = 1.0                 # each router replica pings the state store this often (/ready, kvnotes_state_store_up)
    # a validated API key is trusted this long per router replica without a store read: a revoked key
    # still works for up to auth_cache_s; during a state store outage recently seen keys keep working (0 = off)
    auth_cache_s: float = 30.0
    tenant: str = "default"                    # tenant of the key the embedded default creates (and of every request when auth is off)
    # who may do what (cluster.http.auth): API keys map to tenants in the state store (`kvnotes keys ...`)
    auth: bool = True                          # False only allowed with a loopback host
    trusted_proxies: tuple[str, ...] = ()      # client IPs whose x-kvnotes-tenant header is honoured (after their own key)
    # request limits (cluster.http.body): 413 / 400 / 429
    max_body_bytes: int = 8 << 20              # largest request body (bytes) -> 413
    max_text_chars: int = 400_000              # per text field: segment text, prompt, message content, registration
    max_segments: int = 256                    # segments (native) or messages (chat) per request
    max_template_fields: int = 64              # {placeholders} per template
    max_name_chars: int = 128                  # skill / memory / template / session names
    max_stop: int = 4                          # stop strings per request
    max_stop_chars: int = 128                  # characters per stop string
    max_choices: int = 8                       # OpenAI `n`: independent samples per request, at most
    grammar_cache_entries: int = 64            # structured outputs: compiled grammars a decode worker keeps (LRU)
    max_inflight_per_tenant: int = 64          # requests one tenant may have in flight per router replica -> 429
    # admission control (cluster.control.admission): each router replica predicts a request's queue wait
    # (requests admitted and not yet at their first token x the measured seconds between first tokens)
    # and refuses at once what would wait longer than this (or than the request's own deadline_s):
    # 429 when the tenant is over its share of the queue, 503 when the cluster is full, both with Retry-After
    admission: bool = True
    max_queue_wait_s: float = 30.0
    admission_tenant_window_s: float = 10.0    # a tenant seen this recently holds a share of the queue
    admission_cold_queue: int = 64             # queue bound before the first service time is measured
    admission_ewma_alpha: float = 0.2          # weight of the newest service-interval sample
    router_max_ongoing_requests: int = 256     # Serve's per-replica concurrency (must exceed max_inflight_per_tenant)
    router_max_queued_requests: int = 64       # Serve's own queue in front of the replicas (its 503 past that)
    metrics_tenants: tuple[str, ...] = ()      # tenants with their own label on kvnotes_requests_total (others: "other")
    ray_address: str | None = None             # None: start/attach local Ray; "auto" or host:port: join a cluster
    ray_auth_mode: str | None = None           # token | disabled; None: token if ~/.ray/auth_token exists (Ray 2.60)
    # fault handling and routing (cluster.control.health, cluster.control.routing)
    worker_max_restarts: int = 5               # Ray restarts a dead worker actor this often (-1: forever)
    health_period_s: float = 1.0               # each router replica calls health() on every worker this often
    health_timeout_s: float = 5.0              # a worker that does not answer within this is marked down
    request_retries: int = 1                   # retries elsewhere of a request whose worker died before its 1st token
    decode_migrations: int = 1                 # times one request may continue on another decode worker when its
                                               # own dies mid-stream (0: the stream ends with an error instead)
    prefill_load_factor: float = 1.0           # prefill affinity load cap: factor x mean in-flight requests per actor
    request_deadline_s: float = 600.0          # default per-request deadline (a request may ask for less: deadline_s)
    start_timeout_s: float = 600.0             # start_workers gives up (naming the missing resources) after this
    ray_start_attempts: int = 2                # a local Ray whose raylet does not come up is shut down and started again, logged
    # fidelity targets (cluster.control.planner.choose_compose reads the model's measured profile)
    # balanced: the cheapest compose op whose `compose_answers` row (cluster.control.planner.FidelityTarget.answers)
    # has top-1 agreement >= balanced_min_top1, accuracy drop vs recompute <= balanced_max_accuracy_drop
    # (one-sided 95% bound), decision agreement >= balanced_min_decision, r <= balanced_max_recompute_ratio,
    # measured on >= balanced_min_cases cases (and as many judged answers; decision cases: BALANCED_MIN_CASES)
    balanced_min_top1: float = BALANCED_ANSWER_TARGET["top1"]
    balanced_max_accuracy_drop: float = BALANCED_ANSWER_TARGET["drop_bound"]
    balanced_min_decision: float = BALANCED_ANSWER_TARGET["decision"]
    balanced_max_recompute_ratio: float = BALANCED_ANSWER_TARGET["max_ratio"]
    balanced_min_cases: int = BALANCED_MIN_CASES["cases"]
    fast_min_top1: float | None = None         # fast: None = reposition + seam_tokens without a target (next-token rows)
    # online shadow checks (cluster.control.shadow): recompute a sample of approximate and frame-variant requests after the response
    shadow_fraction: float = 0.01              # share of approximate and frame-variant (reuse(frame)) requests checked (0 = off)
    shadow_opt_out_tenants: tuple = ()         # tenants never checked
    shadow_max_in_flight: int = 2              # checks pending at once; more are dropped (counted)
    shadow_window: int = 50                    # results per operation in the agreement window
    shadow_min_samples: int = 20               # no demotion before this many results
    shadow_demote_s: float = 600.0             # a demoted operation is retried (on probation) after this

    def __post_init__(self):
        if self.default_policy not in ("exact", "balanced", "fast"):
            raise ValueError("default_policy must be exact, balanced or fast")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be recompute or fail")
        if self.kv_transport not in ("auto", "nixl", "grpc"):
            raise ValueError(f"kv_transport must be auto, nixl or grpc, got {self.kv_transport!r}")
        for name in ("kv_grpc", "kv_nixl"):
            object.__setattr__(self, name, _options(name, getattr(self, name)))
        if self.decode_engine not in ("reference", "vllm"):
            raise ValueError("decode_engine must be reference or vllm")
        if not isinstance(self.decode_prefix_cache_bytes, int) or self.decode_prefix_cache_bytes < 0:
            raise ValueError("decode_prefix_cache_bytes must be an integer >= 0 (0 = off)")
        if self.vllm_kv_cache_gib <= 0 or self.vllm_max_model_len < 16 or self.vllm_max_concurrency < 1:
            raise ValueError("vllm_kv_cache_gib > 0, vllm_max_model_len >= 16 and vllm_max_concurrency >= 1 required")
        if self.vllm_kv_load not in ("async", "sync") or self.vllm_kv_load_threads < 1:
            raise ValueError("vllm_kv_load must be async or sync and vllm_kv_load_threads >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        from kvruntime.models import is_model_name
        if not isinstance(self.model, str) or not is_model_name(self.model):
            raise ValueError(f"model must be a registry name or a checkpoint directory with a config.json, "
                             f"got {self.model!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError("served_model_name must be a non-empty string (or unset)")
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if self.seam_tokens < 0 or self.max_tokens_limit < 1 or self.transfer_timeout_s <= 0:
            raise ValueError("seam_tokens >= 0, max_tokens_limit >= 1 and transfer_timeout_s > 0 required")
        if not 0 < self.state_timeout_s <= 60 or not 0 < self.state_probe_s <= 60:
            raise ValueError("state_timeout_s and state_probe_s must be in (0, 60] seconds")
        if not 0 <= self.auth_cache_s <= 3600:
            raise ValueError(f"auth_cache_s must be in [0, 3600] seconds (0 = no cache), got {self.auth_cache_s}")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.session_ttl_s <= 0 or self.prompt_index_ttl_s <= 0 or self.session_max < 1 or self.prompt_index_max < 1:
            raise ValueError("session_ttl_s, prompt_index_ttl_s > 0 and session_max, prompt_index_max >= 1 required")
        if not isinstance(self.tier_remote_capacity_bytes, int) or self.tier_remote_capacity_bytes < 1 << 20:
            raise ValueError("tier_remote_capacity_bytes must be an integer >= 1 MiB (1048576)")
        if not 0 < self.tier_remote_probe_s <= 60:
            raise ValueError(f"tier_remote_probe_s must be in (0, 60], got {self.tier_remote_probe_s}")
        if self.state_url is not None and not self.state_url.startswith(("sqlite:///", "redis://", "rediss://")):
            raise ValueError("state_url must start with sqlite:///, redis:// or rediss://")
        if self.bind_host is not None and not _is_concrete_ip(self.bind_host):
            raise ValueError(f"bind_host must be one IP address that other processes can reach (not 0.0.0.0 or ::), "
                             f"got {self.bind_host!r}")
        if self.metrics_auth and not self.auth:
            raise ValueError("metrics_auth: true needs auth: true (API keys)")
        if not self.auth and not _is_loopback(self.host):
            raise ValueError(f"auth: false is only allowed when host is a loopback address, not {self.host!r}")
        if not isinstance(self.metrics_tenants, (list, tuple)) or \
                not all(isinstance(t, str) and t for t in self.metrics_tenants) or len(self.metrics_tenants) > 100:
            raise ValueError("metrics_tenants must be a list of at most 100 tenant names (label cardinality)")
        object.__setattr__(self, "metrics_tenants", tuple(self.metrics_tenants))
        if not isinstance(self.trusted_proxies, tuple) or not all(isinstance(p, str) and p for p in self.trusted_proxies):
            raise ValueError("trusted_proxies must be a list of IP addresses")
        if min(self.max_body_bytes, self.max_text_chars, self.max_segments, self.max_template_fields,
               self.max_name_chars, self.max_stop, self.max_stop_chars, self.max_inflight_per_tenant,
               self.max_choices, self.grammar_cache_entries) < 1:
            raise ValueError("every max_* limit must be >= 1")
        if self.max_queue_wait_s <= 0 or self.admission_tenant_window_s <= 0 or self.admission_cold_queue < 1 \
                or not 0 < self.admission_ewma_alpha <= 1:
            raise ValueError("max_queue_wait_s, admission_tenant_window_s > 0, admission_cold_queue >= 1 and "
                             "admission_ewma_alpha in (0, 1] required")
        if self.router_max_queued_requests < 1 or self.router_max_ongoing_requests <= self.max_inflight_per_tenant:
            raise ValueError(f"router_max_ongoing_requests ({self.router_max_ongoing_requests}) must exceed "
                             f"max_inflight_per_tenant ({self.max_inflight_per_tenant}) so that the 429 can fire, "
                             "and router_max_queued_requests must be >= 1")
        if self.ray_auth_mode not in (None, "token", "disabled"):
            raise ValueError("ray_auth_mode must be token or disabled (or unset: token when ~/.ray/auth_token exists)")
        if self.worker_max_restarts < -1 or self.request_retries < 0:
            raise ValueError("worker_max_restarts must be >= -1 and request_retries >= 0")
        if not isinstance(self.decode_migrations, int) or not 0 <= self.decode_migrations <= 8:
            raise ValueError(f"decode_migrations must be an integer in 0..8, got {self.decode_migrations!r}")
        if self.health_period_s <= 0 or self.health_timeout_s <= 0 or self.prefill_load_factor < 1.0:
            raise ValueError("health_period_s, health_timeout_s > 0 and prefill_load_factor >= 1.0 required")
        if self.request_deadline_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("request_deadline_s and start_timeout_s must be > 0")
        if self.ray_start_attempts < 1:
            raise ValueError("ray_start_attempts must be >= 1")
        self.prefill.validate("prefill")
        self.decode.validate("decode")
        for name in ("balanced_min_top1", "fast_min_top1", "balanced_max_accuracy_drop", "balanced_min_decision",
                     "balanced_max_recompute_ratio"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if not isinstance(self.balanced_min_cases, int) or self.balanced_min_cases < 1:
            raise ValueError(f"balanced_min_cases must be an integer >= 1, got {self.balanced_min_cases!r}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError("shadow_fraction must be in [0, 1]")
        if not isinstance(self.shadow_opt_out_tenants, (list, tuple)) or \
                not all(isinstance(t, str) for t in self.shadow_opt_out_tenants):
            raise ValueError("shadow_opt_out_tenants must be a list of tenant names")
        object.__setattr__(self, "shadow_opt_out_tenants", tuple(self.shadow_opt_out_tenants))
        if self.shadow_max_in_flight < 1 or not 1 <= self.shadow_min_samples <= self.shadow_window \
                or self.shadow_demote_s <= 0:
            raise ValueError("shadow_max_in_flight >= 1, 1 <= shadow_min_samples <= shadow_window and "
                             "shadow_demote_s > 0 required")

    def transport_options(self, transport: str) -> dict:
        """``kv_grpc`` / ``kv_nixl`` as keyword arguments (``transport``: grpc | nixl)."""
        if transport not in ("grpc", "nixl"):
            raise ValueError(f"transport must be grpc or nixl, got {transport!r}")
        return dict(self.kv_grpc if transport == "grpc" else self.kv_nixl)

    def served_name(self, spec_name: str) -> str:
        """The ``model`` clients send and see: ``served_model_name``, else the registry name, else
        the checkpoint directory's own name (``/models/Qwen3-8B`` -> ``Qwen3-8B``). Tier keys and
        block headers use ``spec_name`` (``<dir>-<content hash>``) instead."""
        if self.served_model_name:
            return self.served_model_name
        from kvruntime.models import list_models
        if self.model in list_models():
            return spec_name
        return Path(self.model).expanduser().resolve().name

    @property
    def local_loopback(self) -> bool:
        """No ``ray_address`` and a loopback ``host``: on a one-node Ray cluster, kvnotes' own
        listeners bind 127.0.0.1 (``cluster.ops.launcher.listen_on_loopback``)."""
        return self.ray_address is None and _is_loopback(self.host)

    @property
    def api_key_file(self) -> Path:
        """Where the embedded default keeps the key it created on first start (mode 0600)."""
        return Path(self.data_dir).expanduser() / "api_key"

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
        if isinstance(kw.get("state_url"), str):
            kw["state_url"] = expand_env(kw["state_url"], "state_url")
        if isinstance(kw.get("trusted_proxies"), list):
            kw["trusted_proxies"] = tuple(kw["trusted_proxies"])
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


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, key: str) -> str:
    """``value`` with each ``${NAME}`` replaced by the environment variable NAME, URL-quoted (a
    password may hold ``@ : /``); a ``$`` not in that form stays as it is. ValueError naming the
    variable (never a value) when it is unset. One pass: an expanded value is not expanded again."""
    from urllib.parse import quote

    def sub(m: re.Match) -> str:
        v = os.environ.get(m.group(1))
        if v is None:
            raise ValueError(f"{key}: environment variable {m.group(1)} is not set")
        return quote(v, safe="")
    return _ENV_REF.sub(sub, value)


def _is_concrete_ip(host) -> bool:
    import ipaddress
    try:
        return isinstance(host, str) and not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _options(name: str, value) -> tuple:
    """A transport option mapping as a sorted tuple of (key, value) pairs (hashable, like the
    rest of the frozen config); lists become tuples. Keys are checked against the transport's
    own config class by :func:`kvtransport.transfer.options.check` (this module imports no transport)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, tuple(v) if isinstance(v, list) else v) for k, v in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a mapping of option names to values") from None
    bad = [k for k, v in pairs if not isinstance(k, str) or not isinstance(v, (bool, int, float, str, tuple))]
    if bad:
        raise ValueError(f"{name}: option {bad[0]!r} must be a name with a number, string, boolean or list value")
    return tuple(sorted(pairs))
