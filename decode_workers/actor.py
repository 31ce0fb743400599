"""The decode worker as a Ray actor: a decode engine and the gRPC KV receiver.

``decode_engine`` in config picks the engine: ``reference`` (torch, the oracle; the actor's
own gRPC inbox) or ``vllm`` (a vLLM v1 engine whose kvnotes KV connector owns the inbox and
writes the received prefix into vLLM's paged cache). ``generate`` is a generator method: the
router calls it with ``num_returns="streaming"`` and forwards each token as it is produced.
Plain class; ``cluster.ray_backends`` applies ``ray.remote`` with resources from config.
"""
from __future__ import annotations

import os
import threading

from kvruntime.messages.config import ClusterConfig


class DecodeWorker:
    def __init__(self, cfg: ClusterConfig, index: int, host: str = "127.0.0.1"):
        self.index, self.engine_kind, self.model = index, cfg.decode_engine, cfg.model
        self._cancelled: set[str] = set()          # request keys whose deadline passed (cancel())
        self._cancel_lock = threading.Lock()
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

    def health(self) -> dict:
        """Cheap liveness answer (the actor's "health" concurrency group, beside a running
        generate): process id and the gRPC address (new after a restart)."""
        return {"worker": f"decode-{self.index}", "pid": os.getpid(), "grpc": self._address}

    def cancel(self, key: str) -> None:
        """Stop the generate() call started with ``cancel_key=key`` after its current token
        (deadline passed, client gone). Runs in the "health" group, beside generate."""
        with self._cancel_lock:
            self._cancelled.add(key)

    def generate(self, transfer_id, prefix, suffix, sampling, salt=None, cancel_key=None):
        gen = self.executor.generate(transfer_id, prefix, suffix, sampling, salt=salt)
        try:
            for ev in gen:
                if cancel_key is not None and cancel_key in self._cancelled:
                    return                     # cancelled: the router stops reading and counts it
                yield ev
        finally:
            gen.close()
            if cancel_key is not None:
                with self._cancel_lock:
                    self._cancelled.discard(cancel_key)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.stop()
        else:
            self.executor.stop()
