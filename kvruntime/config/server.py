"""The ``server`` section: where the HTTP API listens, who may call it and how much one request
may ask for (``cluster.http.auth``, ``cluster.http.body``, ``cluster.control.limits``)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass


ROUTER_RESOURCE_UNITS = 0.01     # of ``router_resource`` per router replica


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # kvnotes' own listeners (decode inboxes, metrics exporters): None = the address Ray runs on, or 127.0.0.1
    # for a one-node cluster serving a loopback host (launcher.listen_on_loopback); an IP: bound and advertised
    bind_host: str | None = None
    served_model_name: str | None = None       # the API's `model` (sent and shown); None: registry name, or the directory's name
    router_replicas: int = 1                   # stateless Serve router replicas (all read the state store)
    # a custom resource every router replica needs ROUTER_RESOURCE_UNITS of (0.01: up to 100 per node declaring
    # {name: 1}): pins the routers to the node types that declare it (deploy/cluster.yaml: the head), so a lost
    # worker node cannot take a router and its open streams with it; None = anywhere (num_cpus 0)
    router_resource: str | None = None
    # who may do what (cluster.http.auth): API keys map to tenants in the state store (`kvnotes keys ...`)
    auth: bool = True                          # False only allowed with a loopback host
    metrics_auth: bool = False                 # GET /metrics/targets (the map of internal endpoints) needs an API key
    tenant: str = "default"                    # tenant of the key the embedded default creates (and of every request when auth is off)
    # proxies (IP addresses or networks) whose x-kvnotes-tenant header is honoured (after their own key) and
    # whose X-Forwarded-For names the client (cluster.http.forwarded); nobody else's forwarded headers count
    trusted_proxies: tuple[str, ...] = ()
    docs: bool = False                         # serve /docs and /openapi.json (off: 404)
    # the router's HTTPS (Ray Serve's ssl_certfile / ssl_keyfile); unset: plain HTTP, a TLS terminator in front
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # unknown API keys (cluster.http.auth): one refused is remembered this long per replica without another
    # store read (0 = off), and each client address may have the store asked about unknown keys this often
    # per second (bursts of unknown_key_burst; beyond: 429 with Retry-After; 0 = no limit)
    unknown_key_cache_s: float = 10.0
    unknown_key_rate_per_s: float = 1.0
    unknown_key_burst: int = 20
    # a validated API key is trusted this long per router replica without a store read: a revoked key
    # still works for up to auth_cache_s; during a state store outage recently seen keys keep working (0 = off)
    auth_cache_s: float = 30.0
    # request limits (cluster.http.body, cluster.control.limits): 413 / 400 / 429
    max_tokens_limit: int = 2048               # largest max_tokens a request may ask for
    max_body_bytes: int = 8 << 20              # largest request body (bytes) -> 413
    max_text_chars: int = 400_000              # per text field: segment text, prompt, message content, registration
    max_segments: int = 256                    # segments (native) or messages (chat) per request
    max_template_fields: int = 64              # {placeholders} per template
    max_name_chars: int = 128                  # skill / memory / template / session names
    max_stop: int = 4                          # stop strings per request
    max_stop_chars: int = 128                  # characters per stop string
    max_choices: int = 8                       # OpenAI `n`: independent samples per request, at most
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
    # a TTFT objective: refuse also what is predicted to reach its first token later than this many times
    # the replica's own unloaded TTFT p90 (requests admitted to an empty queue); 0 = off
    admission_ttft_factor: float = 0.0
    # while the objective applies, a request about to be admitted is checked again against the other
    # replicas' queues as one prefill worker holds them now (cluster.control.exchange); no answer within
    # this many seconds: the last heard view decides (counted); 0 = off
    admission_exchange_timeout_s: float = 0.2
    router_max_ongoing_requests: int = 256     # Serve's per-replica concurrency (must exceed max_inflight_per_tenant)
    router_max_queued_requests: int = 64       # Serve's own queue in front of the replicas (its 503 past that)
    # a stopping router replica (delete, redeploy, kvnotes stop) sleeps this long, then counts its ongoing
    # requests, again until none is left (Serve's graceful_shutdown_wait_loop_s, default 2 s)
    router_shutdown_wait_loop_s: float = 0.5
    metrics_tenants: tuple[str, ...] = ()      # tenants with their own label on kvnotes_requests_total (others: "other")

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError("served_model_name must be a non-empty string (or unset)")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.router_resource is not None and (not isinstance(self.router_resource, str)
                                                 or not self.router_resource.strip()
                                                 or self.router_resource in ("CPU", "GPU", "memory")):
            raise ValueError(f"router_resource must be a custom resource name (not CPU/GPU/memory), "
                             f"got {self.router_resource!r}")
        if self.bind_host is not None and not is_concrete_ip(self.bind_host):
            raise ValueError(f"bind_host must be one IP address that other processes can reach (not 0.0.0.0 or ::), "
                             f"got {self.bind_host!r}")
        if self.metrics_auth and not self.auth:
            raise ValueError("metrics_auth: true needs auth: true (API keys)")
        if not self.auth and not is_loopback(self.host):
            raise ValueError(f"auth: false is only allowed when host is a loopback address, not {self.host!r}")
        if not 0 <= self.auth_cache_s <= 3600:
            raise ValueError(f"auth_cache_s must be in [0, 3600] seconds (0 = no cache), got {self.auth_cache_s}")
        proxies = tuple(self.trusted_proxies) if isinstance(self.trusted_proxies, list) else self.trusted_proxies
        if not isinstance(proxies, tuple) or not all(isinstance(p, str) and p for p in proxies):
            raise ValueError("trusted_proxies must be a list of IP addresses or networks")
        for p in proxies:
            try:
                ipaddress.ip_network(p.strip(), strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {p!r} is not an IP address or network "
                                 f"(e.g. 10.0.0.7 or 10.0.0.0/24)") from None
        if self.tls_cert_file is not None or self.tls_key_file is not None:
            if not (isinstance(self.tls_cert_file, str) and isinstance(self.tls_key_file, str)):
                raise ValueError("tls_cert_file and tls_key_file go together (the router's HTTPS, Serve's ssl options)")
        if self.unknown_key_cache_s < 0 or self.unknown_key_rate_per_s < 0 or self.unknown_key_burst < 1:
            raise ValueError("unknown_key_cache_s, unknown_key_rate_per_s must be >= 0 (0 = off) and "
                             "unknown_key_burst >= 1")
        object.__setattr__(self, "trusted_proxies", proxies)
        if not isinstance(self.metrics_tenants, (list, tuple)) or \
                not all(isinstance(t, str) and t for t in self.metrics_tenants) or len(self.metrics_tenants) > 100:
            raise ValueError("metrics_tenants must be a list of at most 100 tenant names (label cardinality)")
        object.__setattr__(self, "metrics_tenants", tuple(self.metrics_tenants))
        if self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")
        if min(self.max_body_bytes, self.max_text_chars, self.max_segments, self.max_template_fields,
               self.max_name_chars, self.max_stop, self.max_stop_chars, self.max_inflight_per_tenant,
               self.max_choices) < 1:
            raise ValueError("every max_* limit must be >= 1")
        if self.max_queue_wait_s <= 0 or self.admission_tenant_window_s <= 0 or self.admission_cold_queue < 1 \
                or not 0 < self.admission_ewma_alpha <= 1:
            raise ValueError("max_queue_wait_s, admission_tenant_window_s > 0, admission_cold_queue >= 1 and "
                             "admission_ewma_alpha in (0, 1] required")
        if not self.admission_exchange_timeout_s >= 0:
            raise ValueError(f"admission_exchange_timeout_s must be >= 0 (0: off), got {self.admission_exchange_timeout_s}")
        if not (self.admission_ttft_factor == 0 or self.admission_ttft_factor >= 1):
            raise ValueError(f"admission_ttft_factor must be 0 (off) or >= 1 (times the unloaded TTFT p90), "
                             f"got {self.admission_ttft_factor}")
        if not 0 < self.router_shutdown_wait_loop_s <= 60:
            raise ValueError(f"router_shutdown_wait_loop_s must be in (0, 60] seconds, got {self.router_shutdown_wait_loop_s}")
        if self.router_max_queued_requests < 1 or self.router_max_ongoing_requests <= self.max_inflight_per_tenant:
            raise ValueError(f"router_max_ongoing_requests ({self.router_max_ongoing_requests}) must exceed "
                             f"max_inflight_per_tenant ({self.max_inflight_per_tenant}) so that the 429 can fire, "
                             "and router_max_queued_requests must be >= 1")


def is_concrete_ip(host) -> bool:
    """One IP address other processes can reach (not the unspecified 0.0.0.0 / ::)."""
    try:
        return isinstance(host, str) and not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
