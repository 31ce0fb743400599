"""Ray wiring: create the prefill and decode actors from config and expose them to the router
as :class:`~cluster.control.backends.Backends`.

Topology: HTTP -> Serve ingress (router, ``router_replicas`` stateless replicas) -> prefill actor (plan execution, LMCache
tier) --KV block (NIXL or gRPC, granted per transfer)--> decode actor (suffix prefill, decode) -> tokens streamed back to the
ingress through a Ray streaming generator. Workers are *named, detached-from-Serve actors*
rather than Serve deployments: a request must reach one specific decode actor (the one the KV
was pushed to), and each decode actor owns a gRPC server with a stable address, which Serve's
load-balanced handles would hide.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import ray

from cluster.control.backends import Backends
from cluster.control.health import ACTOR_LOST, HEALTH_GROUP, HealthMonitor
from cluster.control.probe import PROBE_GROUP
from cluster.control.routing import FaultPolicy, WorkerLost, WorkerView
from kvruntime.config import ClusterConfig, WorkerConfig
from decode_workers.actor import DecodeWorker
from prefill_workers.actor import PrefillWorker

log = logging.getLogger(__name__)
NAMESPACE = "kvnotes"
# a third thread in each actor: the plan-time tier lookup (``contains``) answers beside a running
# execute, precompile or store-behind compile (in the default group it waited for them: seconds)
LOOKUP_GROUP = "lookup"
ACTOR_GROUPS = {HEALTH_GROUP: 1, PROBE_GROUP: 1, LOOKUP_GROUP: 1}


def _options(cfg: ClusterConfig, w: WorkerConfig, kind: str, name: str) -> dict:
    opts = {"num_cpus": w.num_cpus, "num_gpus": w.num_gpus, "name": name, "namespace": NAMESPACE,
            "lifetime": "detached", "get_if_exists": True, "max_restarts": cfg.workers.max_restarts}
    if w.custom_resource:
        opts["resources"] = {kind: 1}
    return opts


def worker_resources(cfg: ClusterConfig, kind: str) -> dict[str, float]:
    """What one actor of ``kind`` asks Ray for (deploy/cluster.yaml's node types provide it)."""
    w = cfg.workers.prefill if kind == "prefill" else cfg.workers.decode
    want = {"CPU": w.num_cpus, "GPU": w.num_gpus, **({kind: 1.0} if w.custom_resource else {})}
    return {k: float(v) for k, v in want.items() if v}


def start_workers(cfg: ClusterConfig) -> tuple[list, list]:
    """Create (or find) the named actors and wait until each loaded its model, at most
    ``start_timeout_s``: then the actors are removed and ``RuntimeError`` names the missing ones
    and the resources they wait for."""
    # PYTHONHASHSEED: LMCache falls back to Python's hash() without vLLM; fix it so keys agree across processes
    env = {"env_vars": {"LMCACHE_TRACK_USAGE": "false", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}}
    groups = ACTOR_GROUPS
    key = tier_key_of(cfg)
    pre = [ray.remote(concurrency_groups=groups)(PrefillWorker)
           .options(runtime_env=env, **_options(cfg, cfg.workers.prefill, "prefill", f"prefill-{i}")).remote(cfg, i, key)
           for i in range(cfg.workers.prefill.count)]
    dec = []
    for i in range(cfg.workers.decode.count):
        dopts = _options(cfg, cfg.workers.decode, "decode", f"decode-{i}")
        if cfg.workers.decode_engine == "vllm":
            # a threaded actor: concurrent generate() calls reach one vLLM engine, which batches them
            dopts["max_concurrency"] = cfg.workers.vllm_max_concurrency
        dec.append(ray.remote(concurrency_groups=groups)(DecodeWorker).options(runtime_env=env, **dopts)
                   .remote(cfg, i))
    names = [f"prefill-{i}" for i in range(len(pre))] + [f"decode-{i}" for i in range(len(dec))]
    refs = [a.ready.remote() for a in pre + dec]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=cfg.workers.start_timeout_s)
    if pending:
        missing = [n for n, r in zip(names, refs) if r in set(pending)]
        stop_workers(cfg)
        raise RuntimeError(_start_timeout_message(cfg, missing))
    try:
        infos = ray.get(refs)
    except ray.exceptions.RayError as exc:     # an actor died while loading: one line, not a traceback
        stop_workers(cfg)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RuntimeError(f"a worker actor failed while starting: {type(exc).__name__}: {first}") from None
    for info in infos:
        log.info("worker ready: %s", info)
    return pre, dec


def tier_key_of(cfg: ClusterConfig) -> bytes | None:
    """The lm:// tier key (kvtransport.tier.auth.tier_key of the cluster secret in the state
    store), or None without a remote tier. Ray keeps it in the actors' creation arguments, so a
    restarted prefill actor gets it again."""
    if not cfg.tier.remote_url:
        return None
    from cluster.control.state import configured_limits, open_state
    from kvtransport.tier.auth import tier_key
    state = open_state(cfg.state.resolved_url, configured_limits(cfg))
    try:
        return tier_key(state.secret())
    finally:
        state.close()


def _start_timeout_message(cfg: ClusterConfig, missing: list[str]) -> str:
    """Which of the missing actors no node can hold (and what they need), and which are still
    loading (placed, but the model load did not finish in time)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    unplaceable, loading = [], []
    for name in missing:
        want = worker_resources(cfg, name.split("-")[0])
        if any(all(res.get(k, 0.0) >= v for k, v in want.items()) for res in nodes):
            loading.append(name)
            continue
        short = [k for k, v in want.items() if not any(res.get(k, 0.0) >= v for res in nodes)]
        most = {k: max((res.get(k, 0.0) for res in nodes), default=0.0) for k in short}
        unplaceable.append(f"{name} needs {want} but no node has {', '.join(f'{k} {want[k]:g}' for k in short)} "
                           f"(largest: {', '.join(f'{k} {v:g}' for k, v in most.items())})")
    parts = unplaceable + ([f"{', '.join(loading)} placed but still loading (or waiting for resources in use)"]
                           if loading else [])
    return (f"{len(missing)} worker actor(s) did not start within {cfg.workers.start_timeout_s:g} s: "
            + "; ".join(parts))


def stop_workers(cfg: ClusterConfig) -> None:
    for kind, n in (("prefill", cfg.workers.prefill.count), ("decode", cfg.workers.decode.count)):
        for i in range(n):
            try:
                ray.kill(ray.get_actor(f"{kind}-{i}", namespace=NAMESPACE))
            except ValueError:
                pass  # not running: nothing to stop


class RayBackends(Backends):
    """:class:`~cluster.control.backends.Backends` over actor handles. Ray's actor errors become
    :class:`~cluster.control.routing.WorkerLost` (and mark the worker down in :attr:`view`), so the
    router retries without knowing Ray."""
    cancels = True       # cancels run in each actor's "health" concurrency group, beside the work

    def __init__(self, prefill: list, decode: list, cfg: ClusterConfig | None = None):
        cfg = cfg or ClusterConfig()
        self.prefill_actors, self.decode_actors = prefill, decode
        self.num_prefill, self.num_decode = len(prefill), len(decode)
        # each decode actor's KV endpoint (gRPC address on its node, NIXL agent metadata): handed to
        # prefill actors with every push, so a restarted prefill actor needs no other exchange
        self.endpoints = ray.get([d.endpoint.remote() for d in decode])
        self.addresses = [e.grpc_address for e in self.endpoints]
        self.ready = ray.get([a.ready.remote() for a in prefill])
        self.view = WorkerView(self.num_prefill, self.num_decode, prefill_load_factor=cfg.routing.prefill_load_factor)
        r = cfg.routing
        self.fault_policy = FaultPolicy(r.request_retries, r.request_deadline_s, r.decode_migrations)
        self.cfg = cfg
        self.remote_up: dict[int, bool] = {}      # prefill index -> remote tier reachable (if configured)
        self.health_sweeps = 0                    # completed health sweeps (/ready waits for the first)
        self._monitor = None

    @staticmethod
    def from_names(cfg: ClusterConfig) -> "RayBackends":
        pre = [ray.get_actor(f"prefill-{i}", namespace=NAMESPACE) for i in range(cfg.workers.prefill.count)]
        dec = [ray.get_actor(f"decode-{i}", namespace=NAMESPACE) for i in range(cfg.workers.decode.count)]
        return RayBackends(pre, dec, cfg)

    def actors(self, role: str) -> list:
        return self.prefill_actors if role == "prefill" else self.decode_actors

    def start_health(self, metrics) -> None:
        """Start the health thread (once): it keeps :attr:`view` and the metrics current."""
        if self._monitor is None:
            r = self.cfg.routing
            self._monitor = HealthMonitor(self, metrics, r.health_period_s, r.health_timeout_s)
            self._monitor.start()

    def exchange_queues(self, report, timeout_s: float):
        """The admission exchange (``cluster.control.exchange``) with the ledger, the first live prefill
        worker, through this replica's prober actor: an ObjectRef of every replica's queue, or None."""
        live = self.view.live("prefill")
        prober = self._monitor.prober() if self._monitor is not None else None
        if not live or prober is None:
            return None
        return prober.exchange.remote(self.prefill_actors[min(live)], report, timeout_s)

    def close(self) -> None:
        """Stop the health thread (before ``ray.shutdown()`` in a driver that built these backends)."""
        if self._monitor is not None:
            self._monitor.stopped.set()
            self._monitor.join(timeout=self.cfg.routing.health_timeout_s + self.cfg.routing.health_period_s)

    def _lost(self, role: str, index: int, exc: BaseException) -> WorkerLost:
        reason = f"{type(exc).__name__}"
        self.view.mark(role, index, False, reason)
        return WorkerLost(role, index, reason)

    async def contains(self, refs, index: int = 0) -> list[bool]:
        try:
            return await self.prefill_actors[index].contains.options(concurrency_group=LOOKUP_GROUP).remote(refs)
        except ACTOR_LOST as exc:
            raise self._lost("prefill", index, exc) from None

    async def precompile(self, ref, index: int = 0, base=None):
        """Compile once, on one prefill actor (``index`` first, then the next ones if it fails):
        it lands in that actor's tiers (shared ones: ``lm://``, ``fs://``); other actors find it
        there or re-warm it on first use. Fails only when every prefill actor failed."""
        errors = []
        order = [(index + k) % self.num_prefill for k in range(self.num_prefill)]
        for i in sorted(order, key=lambda i: not self.view.is_alive("prefill", i)):   # live ones first
            actor = self.prefill_actors[i]
            try:
                return await (actor.precompile.remote(ref) if base is None else actor.precompile.remote(ref, base))
            except ACTOR_LOST as exc:
                self._lost("prefill", i, exc)
                errors.append(f"prefill-{i}: {type(exc).__name__}")
                log.warning("precompile on prefill-%d failed (%s); trying the next actor", i, exc)
        raise RuntimeError(f"no prefill actor could precompile the chunk: {'; '.join(errors)}")

    async def evict(self, ref) -> bool:
        out = False
        for i, a in enumerate(self.prefill_actors):
            try:
                out = await a.evict.remote(ref) or out
            except ACTOR_LOST as exc:      # a dead worker's local tier is gone with it
                self._lost("prefill", i, exc)
        return out

    async def expect(self, decode_index: int, expectation):
        try:
            return await self.decode_actors[decode_index].expect.remote(expectation)
        except ACTOR_LOST as exc:
            raise self._lost("decode", decode_index, exc) from None

    async def prefill(self, index: int, decode_index: int, job):
        try:
            return await self.prefill_actors[index].execute.remote(replace(job, decode=self.endpoints[decode_index]))
        except ACTOR_LOST as exc:
            raise self._lost("prefill", index, exc) from None

    async def decode(self, index: int, job):
        try:
            gen = self.decode_actors[index].generate.options(num_returns="streaming").remote(job)
            async for ref in gen:
                yield await ref
        except ACTOR_LOST as exc:
            raise self._lost("decode", index, exc) from None

    async def cancel(self, index: int, cancel_key: str) -> None:
        """Ask decode worker ``index`` to stop the generate() started with ``cancel_key``."""
        try:
            await self.decode_actors[index].cancel.options(concurrency_group=HEALTH_GROUP).remote(cancel_key)
        except ACTOR_LOST as exc:
            self._lost("decode", index, exc)

    async def cancel_prefill(self, index: int, transfer_id: str) -> None:
        """Ask prefill worker ``index`` to stop the plan it executes (or will) for ``transfer_id``
        at its next layer or step (deadline passed, client gone)."""
        try:
            await self.prefill_actors[index].cancel.options(concurrency_group=HEALTH_GROUP).remote(transfer_id)
        except ACTOR_LOST as exc:
            self._lost("prefill", index, exc)

    async def shadow(self, index: int, plan):
        try:
            return await self.prefill_actors[index].shadow.remote(plan)
        except ACTOR_LOST as exc:
            raise self._lost("prefill", index, exc) from None
