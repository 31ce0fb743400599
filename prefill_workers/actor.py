"""The prefill worker as a Ray actor: a reference engine, the LMCache tier and a gRPC sender.

Plain class; ``cluster.ray_backends`` wraps it with ``ray.remote`` and the resources from
config (so importing this module needs no Ray). One actor executes one plan at a time.
"""
from __future__ import annotations

import logging
import os
import time

from cluster.config import ClusterConfig

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, cfg: ClusterConfig, index: int):
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        from kvruntime.engine import ReferenceEngine
        from kvtransport.grpc_transport import GrpcTransport
        from kvtransport.lmcache_store import LMCacheStore, TierConfig
        from prefill_workers.executor import PrefillExecutor
        from prefill_workers.tier_source import TierSource

        self.cfg, self.index = cfg, index
        device = "cuda" if cfg.prefill.num_gpus > 0 else "cpu"
        self.engine = ReferenceEngine(cfg.model, dtype=cfg.dtype, device=device, threads=cfg.prefill.threads)
        tier = TierConfig(local_cpu_gb=max(cfg.tier_cpu_bytes / 2**30, 0.05),
                          local_disk_dir=cfg.tier_disk_path, local_disk_gb=1.0 if cfg.tier_disk_path else 0.0,
                          remote_url=cfg.tier_remote_url)
        self.store = LMCacheStore.for_engine(self.engine, tier)
        self.source = TierSource(self.store, self.engine)
        self.executor = PrefillExecutor(self.engine, self.source, GrpcTransport(),
                                        load_failure_policy=cfg.kv_load_failure_policy,
                                        transfer_timeout=cfg.transfer_timeout_s)

    def ready(self) -> dict:
        r = self.engine.rope
        return {"worker": f"prefill-{self.index}", "model": self.engine.spec.name,
                "rope_self_test_ok": r.enabled, "rope_self_test_error": r.self_test_error}

    def contains(self, keys: list[str]) -> list[str]:
        return [k for k in keys if self.source.contains(k)]

    def precompile(self, key: str, token_ids: tuple[int, ...], tenant: str) -> dict:
        from kvruntime.ops import precompile_chunk

        if self.source.contains(key):
            return {"cached": True, "bytes": 0, "seconds": 0.0}
        t = time.perf_counter()
        kv = precompile_chunk(self.engine, list(token_ids))
        nbytes = self.source.put_chunk(key, token_ids, kv, tenant)
        return {"cached": False, "bytes": nbytes, "seconds": time.perf_counter() - t}

    def evict(self, key: str) -> bool:
        return self.source.evict(key)

    def execute(self, plan, decode_address: str, transfer_id: str, store_as: str | None):
        return self.executor.execute(plan, decode_address, transfer_id, store_context_as=store_as)

    def tier_stats(self):
        return self.store.stats
