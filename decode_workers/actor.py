"""The decode worker as a Ray actor: a reference engine and the gRPC KV receiver.

``generate`` is a generator method: the router calls it with ``num_returns="streaming"`` and
forwards each token as it is produced. Plain class; ``cluster.ray_backends`` applies
``ray.remote`` with resources from config.
"""
from __future__ import annotations

from cluster.config import ClusterConfig


class DecodeWorker:
    def __init__(self, cfg: ClusterConfig, index: int, host: str = "127.0.0.1"):
        from decode_workers.executor import DecodeExecutor
        from kvruntime.engine import ReferenceEngine
        from kvtransport.grpc_transport import GrpcTransport

        self.index = index
        device = "cuda" if cfg.decode.num_gpus > 0 else "cpu"
        self.engine = ReferenceEngine(cfg.model, dtype=cfg.dtype, device=device, threads=cfg.decode.threads)
        self.transport = GrpcTransport(model=cfg.model)
        self._address = self.transport.serve(host, 0)
        self.executor = DecodeExecutor(self.engine, self.transport, load_failure_policy=cfg.kv_load_failure_policy,
                                       receive_timeout=cfg.transfer_timeout_s)

    def address(self) -> str:
        return self._address

    def ready(self) -> dict:
        return {"worker": f"decode-{self.index}", "model": self.engine.spec.name, "grpc": self._address}

    def generate(self, transfer_id, prefix, suffix, sampling):
        yield from self.executor.generate(transfer_id, prefix, suffix, sampling)

    def shutdown(self) -> None:
        self.transport.stop()
