""":class:`ClusterConfig`: the typed sections, and the loader that reads a config file into them.

A config file (YAML or JSON) may use today's flat keys (``port: 8000``, ``tier_cpu_bytes: ...``,
``prefill: {count: 2}``), each mapped to its section by :data:`FLAT_KEYS`, or the nested form
(``server: {port: 8000}``, ``tier: {cpu_bytes: ...}``), or both; a field set twice, an unknown
key or a bad value is a ValueError naming the key."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvruntime.config.env import expand_env
from kvruntime.config.matching import MatchConfig
from kvruntime.config.policy import PolicyConfig
from kvruntime.config.ray_cluster import RayConfig
from kvruntime.config.routing import RoutingConfig
from kvruntime.config.server import ServerConfig, is_loopback
from kvruntime.config.shadow import ShadowConfig
from kvruntime.config.state import StateConfig
from kvruntime.config.tier import TierConfig
from kvruntime.config.transport import TransportConfig
from kvruntime.config.workers import WorkerConfig, WorkersConfig

SECTIONS: dict[str, type] = {
    "server": ServerConfig, "policy": PolicyConfig, "shadow": ShadowConfig, "tier": TierConfig,
    "transport": TransportConfig, "workers": WorkersConfig, "state": StateConfig, "ray": RayConfig,
    "routing": RoutingConfig, "matching": MatchConfig,
}

# flat keys whose name differs from the section field's; every other field's flat key is its own name
_RENAMED = {
    "shadow_fraction": ("shadow", "fraction"), "shadow_opt_out_tenants": ("shadow", "opt_out_tenants"),
    "shadow_max_in_flight": ("shadow", "max_in_flight"), "shadow_window": ("shadow", "window"),
    "shadow_min_samples": ("shadow", "min_samples"), "shadow_demote_s": ("shadow", "demote_s"),
    "shadow_metric": ("shadow", "metric"),
    "tier_cpu_bytes": ("tier", "cpu_bytes"), "tier_disk_path": ("tier", "disk_path"),
    "tier_remote_url": ("tier", "remote_url"), "tier_remote_capacity_bytes": ("tier", "remote_capacity_bytes"),
    "tier_remote_probe_s": ("tier", "remote_probe_s"), "tier_persist_dir": ("tier", "persist_dir"),
    "tier_local_cpu": ("tier", "local_cpu"), "tier_disk_bytes": ("tier", "disk_bytes"),
    "tier_remote_timeout_s": ("tier", "remote_timeout_s"), "tier_remote_retry_s": ("tier", "remote_retry_s"),
    "tier_confirm_timeout_s": ("tier", "confirm_timeout_s"), "tier_chunk_size": ("tier", "chunk_size"),
    "tier_connector": ("tier", "connector"),
    **{f"tier_remote_tls_{k}": ("tier", f"remote_tls_{k}") for k in ("ca_file", "cert_file", "key_file",
                                                                     "server_name", "client_auth")},
    "kv_transport": ("transport", "kind"), "kv_grpc": ("transport", "grpc"), "kv_nixl": ("transport", "nixl"),
    "worker_max_restarts": ("workers", "max_restarts"),
    "state_url": ("state", "url"), "state_timeout_s": ("state", "timeout_s"), "state_probe_s": ("state", "probe_s"),
    "ray_address": ("ray", "address"), "ray_auth_mode": ("ray", "auth_mode"),
    "ray_start_attempts": ("ray", "start_attempts"), "ray_worker_niceness": ("ray", "worker_niceness"),
    **{f"matching_{f.name}": ("matching", f.name) for f in dataclasses.fields(MatchConfig)},   # every one prefixed
}


# keys an older config file may still carry -> what replaced them (named in the unknown-key error)
_RETIRED = {"vllm_kv_cache_gib": "vllm_kv_cache_bytes (bytes, e.g. 4294967296 for 4 GiB)"}


def _flat_keys() -> dict[str, tuple[str, str]]:
    renamed = {v: k for k, v in _RENAMED.items()}
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = renamed.get((section, f.name), f.name)
            assert key not in out and key not in SECTIONS, f"flat key {key} is ambiguous"
            out[key] = (section, f.name)
    return out


#: flat config key -> (section, field), e.g. ``"tier_cpu_bytes" -> ("tier", "cpu_bytes")``
FLAT_KEYS: dict[str, tuple[str, str]] = _flat_keys()


@dataclass(frozen=True)
class ClusterConfig:
    """Every process (router replicas, prefill and decode actors) receives the same frozen value."""
    server: ServerConfig = field(default_factory=ServerConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    state: StateConfig = field(default_factory=StateConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    matching: MatchConfig = field(default_factory=MatchConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__} (or a mapping of its fields, via from_dict)")

    def __getattr__(self, name: str):
        # only reached for a name that is not a section: say where a flat key lives now
        where = FLAT_KEYS.get(name)
        hint = f": it is config.{where[0]}.{where[1]}" if where else ""
        raise AttributeError(f"ClusterConfig has no attribute {name!r}{hint}")

    def served_name(self, spec_name: str) -> str:
        """The ``model`` clients send and see: ``served_model_name``, else the registry name, else
        the checkpoint directory's own name (``/models/Qwen3-8B`` -> ``Qwen3-8B``). Tier keys and
        block headers use ``spec_name`` (``<dir>-<content hash>``) instead."""
        if self.server.served_model_name:
            return self.server.served_model_name
        from kvruntime.models import list_models
        if self.workers.model in list_models():
            return spec_name
        return Path(self.workers.model).expanduser().resolve().name

    @property
    def local_loopback(self) -> bool:
        """No ``ray.address`` and a loopback ``server.host``: on a one-node Ray cluster, kvnotes' own
        listeners bind 127.0.0.1 (``cluster.operator.launcher.listen_on_loopback``)."""
        return self.ray.address is None and is_loopback(self.server.host)

    def replace(self, **changes) -> "ClusterConfig":
        """A copy with ``changes`` (flat keys, section names with a mapping or section value, as in
        a config file) applied over this config's values."""
        return ClusterConfig.from_dict(changes, base=self)

    @staticmethod
    def of(**keys) -> "ClusterConfig":
        """The defaults with ``keys`` applied, in a config file's form: ``ClusterConfig.of(port=8001,
        tier_cpu_bytes=1 << 28, prefill=WorkerConfig(count=2))``."""
        return ClusterConfig.from_dict(keys)

    @staticmethod
    def from_dict(d: dict, base: "ClusterConfig | None" = None) -> "ClusterConfig":
        """A config file's mapping (flat keys, nested sections, or both) over ``base`` (the defaults)."""
        if not isinstance(d, dict):
            raise ValueError("a config must be a mapping")
        unknown = sorted(k for k in d if k not in FLAT_KEYS and k not in SECTIONS)
        if unknown:
            hints = "".join(f"; {k} is now {_RETIRED[k]}" for k in unknown if k in _RETIRED)
            raise ValueError(f"unknown config key(s): {', '.join(map(str, unknown))}{hints}")
        base = base or ClusterConfig()
        per: dict[str, dict] = {s: {} for s in SECTIONS}
        origin: dict[tuple[str, str], str] = {}

        def put(section: str, name: str, value, key: str) -> None:
            if (section, name) in origin:
                raise ValueError(f"config key {key} sets {section}.{name}, already set by {origin[section, name]}")
            origin[section, name] = key
            per[section][name] = value

        for key, value in d.items():
            if key in SECTIONS:
                cls = SECTIONS[key]
                if isinstance(value, cls):
                    value = {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
                names = {f.name for f in dataclasses.fields(cls)}
                if not isinstance(value, dict):
                    raise ValueError(f"{key} must be a mapping with keys among {sorted(names)}")
                bad = sorted(set(value) - names)
                if bad:
                    raise ValueError(f"unknown config key(s) in {key}: {', '.join(map(str, bad))}")
                for name, v in value.items():
                    put(key, name, v, f"{key}.{name}")
            else:
                put(*FLAT_KEYS[key], value, key)
        if isinstance(per["state"].get("url"), str):
            per["state"]["url"] = expand_env(per["state"]["url"], "state_url")
        for role in ("prefill", "decode"):
            if role in per["workers"]:
                per["workers"][role] = _worker(role, per["workers"][role])
        try:
            return ClusterConfig(**{s: dataclasses.replace(getattr(base, s), **kw) if kw else getattr(base, s)
                                    for s, kw in per.items()})
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


def _worker(role: str, value) -> WorkerConfig:
    if isinstance(value, WorkerConfig):
        return value
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    if not isinstance(value, dict) or set(value) - names:
        raise ValueError(f"{role} must be a mapping with keys among {sorted(names)}")
    try:
        return WorkerConfig(**value)
    except TypeError as exc:
        raise ValueError(f"{role}: {exc}") from None
