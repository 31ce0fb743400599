"""Ray wiring: create the prefill and decode actors from config and expose them to the router
as :class:`~cluster.router.Backends`.

Topology: HTTP -> Serve ingress (router, ``router_replicas`` stateless replicas) -> prefill actor (plan execution, LMCache
tier) --gRPC KV block--> decode actor (suffix prefill, decode) -> tokens streamed back to the
ingress through a Ray streaming generator. Workers are *named, detached-from-Serve actors*
rather than Serve deployments: a request must reach one specific decode actor (the one the KV
was pushed to), and each decode actor owns a gRPC server with a stable address, which Serve's
load-balanced handles would hide.
"""
from __future__ import annotations

import logging

import ray

from kvruntime.messages.config import ClusterConfig, WorkerConfig
from decode_workers.actor import DecodeWorker
from prefill_workers.actor import PrefillWorker

log = logging.getLogger(__name__)
NAMESPACE = "kvnotes"


def _options(w: WorkerConfig, kind: str, name: str) -> dict:
    opts = {"num_cpus": w.num_cpus, "num_gpus": w.num_gpus, "name": name, "namespace": NAMESPACE,
            "lifetime": "detached", "get_if_exists": True, "max_restarts": 0}
    if w.custom_resource:
        opts["resources"] = {kind: 1}
    return opts


def start_workers(cfg: ClusterConfig) -> tuple[list, list]:
    """Create (or find) the named actors and wait until each loaded its model."""
    # PYTHONHASHSEED: LMCache falls back to Python's hash() without vLLM; fix it so keys agree across processes
    env = {"env_vars": {"LMCACHE_TRACK_USAGE": "false", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}}
    pre = [ray.remote(PrefillWorker).options(runtime_env=env, **_options(cfg.prefill, "prefill", f"prefill-{i}"))
           .remote(cfg, i) for i in range(cfg.prefill.count)]
    dec = []
    for i in range(cfg.decode.count):
        dopts = _options(cfg.decode, "decode", f"decode-{i}")
        if cfg.decode_engine == "vllm":
            # a threaded actor: concurrent generate() calls reach one vLLM engine, which batches them
            dopts["max_concurrency"] = cfg.vllm_max_concurrency
        dec.append(ray.remote(DecodeWorker).options(runtime_env=env, **dopts).remote(cfg, i))
    for info in ray.get([a.ready.remote() for a in pre + dec]):
        log.info("worker ready: %s", info)
    return pre, dec


def stop_workers(cfg: ClusterConfig) -> None:
    for kind, n in (("prefill", cfg.prefill.count), ("decode", cfg.decode.count)):
        for i in range(n):
            try:
                ray.kill(ray.get_actor(f"{kind}-{i}", namespace=NAMESPACE))
            except ValueError:
                pass  # not running: nothing to stop


class RayBackends:
    """:class:`~cluster.router.Backends` over actor handles."""

    def __init__(self, prefill: list, decode: list):
        self.prefill_actors, self.decode_actors = prefill, decode
        self.num_prefill, self.num_decode = len(prefill), len(decode)
        self.addresses = ray.get([d.address.remote() for d in decode])
        self.ready = ray.get([a.ready.remote() for a in prefill])

    @staticmethod
    def from_names(cfg: ClusterConfig) -> "RayBackends":
        pre = [ray.get_actor(f"prefill-{i}", namespace=NAMESPACE) for i in range(cfg.prefill.count)]
        dec = [ray.get_actor(f"decode-{i}", namespace=NAMESPACE) for i in range(cfg.decode.count)]
        return RayBackends(pre, dec)

    async def contains(self, refs, index: int = 0) -> list[bool]:
        return await self.prefill_actors[index].contains.remote(refs)

    async def precompile(self, ref, index: int = 0):
        """Compile once, on one prefill actor (``index`` first, then the next ones if it fails):
        it lands in that actor's tiers (shared ones: ``lm://``, ``fs://``); other actors find it
        there or re-warm it on first use. Fails only when every prefill actor failed."""
        errors = []
        for k in range(self.num_prefill):
            actor = self.prefill_actors[(index + k) % self.num_prefill]
            try:
                return await actor.precompile.remote(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                errors.append(f"prefill-{(index + k) % self.num_prefill}: {type(exc).__name__}")
                log.warning("precompile on prefill-%d failed (%s); trying the next actor",
                            (index + k) % self.num_prefill, exc)
        raise RuntimeError(f"no prefill actor could precompile the chunk: {'; '.join(errors)}")

    async def evict(self, ref) -> bool:
        return any([await a.evict.remote(ref) for a in self.prefill_actors])

    async def prefill(self, index: int, plan, decode_index: int, transfer_id: str, store_as):
        return await self.prefill_actors[index].execute.remote(plan, self.addresses[decode_index], transfer_id, store_as)

    async def shadow(self, index: int, plan):
        return await self.prefill_actors[index].shadow.remote(plan)

    async def decode(self, index: int, transfer_id, prefix, suffix, sampling, salt: str):
        gen = self.decode_actors[index].generate.options(num_returns="streaming").remote(
            transfer_id, prefix, suffix, sampling, salt)
        async for ref in gen:
            yield await ref
