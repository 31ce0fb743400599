"""Typed configuration, split by concern. ``kvnotes serve --config FILE`` reads YAML or JSON into
:class:`ClusterConfig`, which holds one frozen section per concern:

- ``server`` (:mod:`.server`): listen address, auth, tenants, request limits.
- ``policy`` (:mod:`.policy`): default KV policy, seam tokens, ``balanced`` / ``fast`` targets.
- ``shadow`` (:mod:`.shadow`): online shadow checks.
- ``tier`` (:mod:`.tier`): where prefill actors keep KV (LMCache CPU / disk / remote / persistent).
- ``transport`` (:mod:`.transport`): NIXL or gRPC, their tuning, what a failed KV load does.
- ``workers`` (:mod:`.workers`): model, dtype, decode engine, per-role counts, resources, device.
- ``state`` (:mod:`.state`): the state store and entry lifetimes.
- ``ray`` (:mod:`.ray_cluster`): which Ray cluster and how it starts.
- ``routing`` (:mod:`.routing`): health checks, retries, migration, affinity, deadlines.
- ``matching`` (:mod:`.matching`): prompt matching past the exact prefix, its fingerprints' bounds.

Config files keep today's flat keys (:data:`FLAT_KEYS` maps each to its section; :mod:`.cluster`
holds the loader) and may use the nested form. Unknown keys and bad values are ``ValueError``
with the key named. Torch-, Ray- and transport-free: every process imports it."""
from kvruntime.config.cluster import FLAT_KEYS, SECTIONS, ClusterConfig
from kvruntime.config.env import expand_env
from kvruntime.config.matching import MatchConfig, SpanConfig
from kvruntime.config.policy import BALANCED_ANSWER_TARGET, BALANCED_MIN_CASES, PolicyConfig
from kvruntime.config.ray_cluster import RayConfig
from kvruntime.config.routing import RoutingConfig
from kvruntime.config.server import ServerConfig
from kvruntime.config.shadow import ShadowConfig
from kvruntime.config.state import StateConfig
from kvruntime.config.tier import TierConfig
from kvruntime.config.transport import TransportConfig
from kvruntime.config.workers import WorkerConfig, WorkersConfig

__all__ = ["FLAT_KEYS", "SECTIONS", "ClusterConfig", "expand_env", "BALANCED_ANSWER_TARGET", "BALANCED_MIN_CASES",
           "MatchConfig", "PolicyConfig", "SpanConfig", "RayConfig", "RoutingConfig", "ServerConfig", "ShadowConfig",
           "StateConfig", "TierConfig",
           "TransportConfig", "WorkerConfig", "WorkersConfig"]
