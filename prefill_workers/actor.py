"""The prefill worker as a Ray actor: a reference engine, the LMCache tier and the KV sender
(``kvtransport.transfer.endpoints.Sender``: NIXL or gRPC by ``kv_transport``).

Plain class; ``cluster.control.ray_backends`` wraps it with ``ray.remote`` and the resources from
config (so importing this module needs no Ray). One actor executes one plan at a time. It keeps
no name map: plans name KV by content (``prefill_workers.tier_reads``), so a restarted or a second
actor finds what the shared or persistent tiers hold. Every log line of a plan carries its
request's id (``kvruntime.request_log``).
"""
from __future__ import annotations

import logging
import os
import threading
import time

from kvruntime import request_log
from kvruntime.config import ClusterConfig
from kvruntime.messages.plan import KVRef, RequestPlan
from kvruntime.messages.fidelity import ShadowResult
from kvruntime.messages.prefill import PrecompileInfo, PrefillJob, PrefillResult
from kvruntime.messages.transfer import KVEndpoint

log = logging.getLogger(__name__)
CANCEL_KEYS = 1024                # cancel keys kept at most (a cancel may arrive after its plan ended)


class PrefillWorker:
    def __init__(self, cfg: ClusterConfig, index: int, tier_key: bytes | None = None):
        """``tier_key``: the ``lm://`` tier's key (``kvtransport.tier.auth.tier_key`` of the cluster
        secret), required when ``cfg.tier.remote_url`` is set; the launcher reads it from the state store."""
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        from kvruntime.cpu_priority import lower_priority
        lower_priority(cfg.workers.model_niceness)    # first: the threads started below inherit it (the control plane first)
        request_log.install(worker=True)
        from kvruntime.engine import ReferenceEngine
        from kvtransport.transfer.endpoints import Sender
        from kvtransport.transfer.options import grpc_config, nixl_config
        from kvtransport.tier.lmcache_store import LMCacheStore
        from prefill_workers.executor import PrefillExecutor
        from prefill_workers.tier_reads import PrefillTier

        self.cfg, self.index = cfg, index
        self._cancelled: dict[str, None] = {}     # transfer ids to stop (cancel()), oldest first
        self._cancel_lock = threading.Lock()
        self.cancelled_plans = 0                  # plans stopped by a cancel (health(), metrics)
        from prefill_workers.queue_reports import QueueReports
        self.queue_reports = QueueReports()       # the router replicas' admission queues (health())
        from kvruntime.device import resolve_device
        device = resolve_device(cfg.workers.prefill.device, "prefill")   # auto: cuda when Ray assigned a GPU and torch sees it
        self.device = device
        self.engine = ReferenceEngine(cfg.workers.model, dtype=cfg.workers.dtype, device=device, threads=cfg.workers.prefill.threads,
                                      shapes=cfg.workers.few_token_shapes)
        from kvruntime.startup_heap import freeze_startup_heap
        freeze_startup_heap()      # imports and model first: LMCacheEngine's own gc.collect() then walks only what follows
        self.store = LMCacheStore.for_engine(self.engine, cfg.tier, remote_key=tier_key if cfg.tier.remote_url else None)
        self.tier = PrefillTier(self.store, self.engine, worker=f"prefill-{index}")
        from kvruntime.telemetry import listen_host
        from kvtransport.transfer.options import confine_ucx
        confine_ucx(listen_host(cfg.server.bind_host))     # NIXL's UCX listens where kvnotes does
        self.sender = Sender(cfg.transport.kind, nixl_cfg=nixl_config(cfg), grpc_cfg=grpc_config(cfg))
        self.executor = PrefillExecutor(self.engine, self.tier, self.sender,
                                        load_failure_policy=cfg.transport.kv_load_failure_policy,
                                        transfer_timeout=cfg.transport.transfer_timeout_s)
        from kvruntime.telemetry import start_exporter
        from prefill_workers.metrics import worker_registry
        self.metrics_target = start_exporter(worker_registry(self.store, f"prefill-{index}", bool(cfg.tier.remote_url),
                                                             cancelled=lambda: self.cancelled_plans,
                                                             variants=lambda: self.tier.variants_compiled),
                                             host=listen_host(cfg.server.bind_host))
        freeze_startup_heap()      # the tiers and sender live as long as the actor: out of GC's walks too

    def ready(self) -> dict:
        r = self.engine.rope
        return {"worker": f"prefill-{self.index}", "model": self.engine.spec.name,
                "rope_self_test_ok": r.enabled, "rope_self_test_error": r.self_test_error, "device": self.device,
                "tiers": self.store.tiers, "node_id": _node_id(),
                "kv_transport": "nixl" if self.sender.nixl is not None else "grpc"}

    def health(self, report=None) -> dict:
        """Cheap liveness answer (runs in the actor's "health" concurrency group, beside a running
        plan): process id, whether the remote tier (if configured) is reachable, and the router
        replicas' admission queues (``report``: the caller's :class:`QueueReport`, recorded first)."""
        st = self.store.stats
        return {"worker": f"prefill-{self.index}", "pid": os.getpid(), "metrics": self.metrics_target,
                "queues": self.queue_reports.update(report),
                "remote_up": st.remote_up if self.cfg.tier.remote_url else None,
                "remote_error": st.remote_last_error if self.cfg.tier.remote_url and not st.remote_up else "",
                "remote_down_misses": st.remote_down_misses, "cancelled": self.cancelled_plans}

    def queues(self, report=None) -> dict:
        """Record ``report`` (a :class:`QueueReport`) and answer every replica's fresh queue, at once
        (called in the probe concurrency group: the admission exchange, ``cluster.control.exchange``)."""
        return self.queue_reports.update(report)

    def contains(self, refs: list[KVRef]) -> list[bool]:
        return self.tier.contains(refs)

    def precompile(self, ref: KVRef, base: KVRef | None = None) -> PrecompileInfo:
        return self.tier.precompile(ref, base)

    def evict(self, ref: KVRef) -> bool:
        return self.tier.evict(ref)

    def cancel(self, transfer_id: str) -> None:
        """Stop the plan executed (or queued) for ``transfer_id`` at its next layer or step: its
        deadline passed or its client left. Runs in the "health" group, beside execute."""
        with self._cancel_lock:
            self._cancelled[transfer_id] = None
            while len(self._cancelled) > CANCEL_KEYS:      # keys of plans that had already ended
                self._cancelled.pop(next(iter(self._cancelled)))

    def execute(self, job: PrefillJob) -> PrefillResult:
        """Build, store and push ``job.plan``'s prefix to ``job.decode`` (``PrefillExecutor.execute``).
        Cancelled (:meth:`cancel`): stops at the next layer or step, counted, and answers a result
        with nothing sent (the router no longer waits for it)."""
        from kvruntime.engine import Cancelled
        from kvruntime.messages.prefill import PrefillStats

        plan, transfer_id = job.plan, job.transfer_id
        if job.decode is None:
            raise ValueError(f"prefill job {transfer_id} names no decode endpoint to push to")
        t = time.perf_counter()
        try:
            with request_log.bound(plan.request_id):
                res = self.executor.execute(plan, job.decode, transfer_id, store_as=job.store_as,
                                            credential=job.credential, send_from=job.send_from,
                                            cancelled=lambda: transfer_id in self._cancelled)
                log.info("prefill-%d: plan %s (%d prompt tokens) built in %.3f s, %d bytes sent by %s%s", self.index,
                         plan.kind.value, plan.prompt_tokens, res.seconds, res.transfer_bytes,
                         res.transport or "none", f"; fallbacks {', '.join(res.stats.fallbacks)}"
                         if res.stats.fallbacks else "")
                return res
        except Cancelled:
            self.cancelled_plans += 1
            with request_log.bound(plan.request_id):
                log.warning("prefill of %s cancelled after %.3f s (deadline passed or client gone)", plan.request_id,
                            time.perf_counter() - t)
            return PrefillResult(plan.request_id, transfer_id, 0, time.perf_counter() - t, 0, 0.0,
                                 PrefillStats(fallbacks=["prefill_cancelled"]), False)
        finally:
            with self._cancel_lock:
                self._cancelled.pop(transfer_id, None)

    def shadow(self, plan: RequestPlan) -> ShadowResult:
        """Recompute ``plan`` in full and compare (online shadow check; the router calls it after the response)."""
        with request_log.bound(plan.request_id):
            return self.executor.shadow(plan)


def _node_id() -> str:
    """The Ray node this actor runs on ("" outside Ray)."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # Ray missing or no runtime context: not placed by Ray
        return ""
