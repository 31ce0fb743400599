"""The decode worker as a Ray actor: a decode engine and the gRPC KV receiver.

``decode_engine`` in config picks the engine: ``reference`` (torch, the oracle; the actor's
own gRPC inbox) or ``vllm`` (a vLLM v1 engine whose kvnotes KV connector owns the inbox and
writes the received prefix into vLLM's paged cache). ``generate`` is a generator method: the
router calls it with ``num_returns="streaming"`` and forwards each token as it is produced.
Plain class; ``cluster.ray_backends`` applies ``ray.remote`` with resources from config.
"""
from __future__ import annotations

from kvruntime.messages.config import ClusterConfig


class DecodeWorker:
    def __init__(self, cfg: ClusterConfig, index: int, host: str = "127.0.0.1"):
        self.index, self.engine_kind, self.model = index, cfg.decode_engine, cfg.model
        device = "cuda" if cfg.decode.num_gpus > 0 else "cpu"
        self.transport = None
        if cfg.decode_engine == "vllm":
            from decode_workers.vllm_engine import VllmDecodeExecutor

            self.executor = VllmDecodeExecutor(
                cfg.model, dtype=cfg.dtype, device=device, load_failure_policy=cfg.kv_load_failure_policy,
                receive_timeout=cfg.transfer_timeout_s, grpc_host=host, kv_cache_gib=cfg.vllm_kv_cache_gib,
                max_model_len=cfg.vllm_max_model_len, threads=cfg.decode.threads)
            self._address = self.executor.address
            return
        from decode_workers.executor import DecodeExecutor
        from kvruntime.engine import ReferenceEngine
        from kvtransport.grpc_transport import GrpcTransport

        self.engine = ReferenceEngine(cfg.model, dtype=cfg.dtype, device=device, threads=cfg.decode.threads)
        self.transport = GrpcTransport(model=cfg.model)
        self._address = self.transport.serve(host, 0)
        self.executor = DecodeExecutor(self.engine, self.transport, load_failure_policy=cfg.kv_load_failure_policy,
                                       receive_timeout=cfg.transfer_timeout_s)

    def address(self) -> str:
        return self._address

    def ready(self) -> dict:
        return {"worker": f"decode-{self.index}", "model": self.model, "engine": self.engine_kind,
                "grpc": self._address}

    def generate(self, transfer_id, prefix, suffix, sampling, salt=None):
        yield from self.executor.generate(transfer_id, prefix, suffix, sampling, salt=salt)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.stop()
        else:
            self.executor.stop()
