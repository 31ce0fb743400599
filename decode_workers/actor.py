"""The decode worker as a Ray actor: a decode engine and the KV receiver.

``decode_engine`` in config picks the engine: ``reference`` (torch, the oracle) or ``vllm`` (a
vLLM v1 engine whose kvnotes KV connector writes the received prefix into vLLM's paged cache).
Either way the actor owns one :class:`~kvtransport.endpoints.Receiver` (``kv_transport``: NIXL
and/or gRPC into one inbox that accepts only transfers the router announced with
:meth:`DecodeWorker.expect`). Its gRPC server binds and advertises the node's address as Ray
reports it (127.0.0.1 on a loopback node) or ``bind_host``, so prefill actors on other nodes reach it; :meth:`DecodeWorker.endpoint` (NIXL agent
metadata included) is what the router hands to prefill actors. ``generate`` is a generator
method: the router calls it with ``num_returns="streaming"`` and forwards each token.
Plain class; ``cluster.control.ray_backends`` applies ``ray.remote`` with resources from config.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from kvruntime.config import ClusterConfig
from kvruntime.messages.keys import token_hash
from kvruntime.messages.plan import decode_computes_rest
from kvruntime.messages.transfer import KVEndpoint, TransferGrant


def node_address() -> tuple[str, str]:
    """(node IP as Ray reports it, Ray node id); ("127.0.0.1", "") outside Ray."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
    except Exception:  # no Ray runtime here: a loopback-only receiver (tests, one process)
        pass
    return "127.0.0.1", ""


class DecodeWorker:
    def __init__(self, cfg: ClusterConfig, index: int, host: str | None = None):
        from kvtransport.endpoints import Receiver
        from kvtransport.options import confine_ucx, grpc_config, nixl_config

        from kvruntime.models import get_model_spec
        # block headers carry the model's spec name (a checkpoint's <dir>-<content hash>), not the config's path
        w = cfg.workers
        self.index, self.engine_kind, self.model = index, w.decode_engine, get_model_spec(w.model).name
        self._cancelled: set[str] = set()          # request keys whose deadline passed (cancel())
        self._cancel_lock = threading.Lock()
        self._own: set[str] = set()                # transfers announced with no block to come (announce)
        from kvruntime.device import actor_device
        device = actor_device(w.decode)
        ip, node_id = node_address()
        host = host or cfg.server.bind_host or ip        # bind_host: kvnotes' listeners bind and advertise it
        confine_ucx(host)                          # NIXL's UCX listens where kvnotes does
        self.receiver = Receiver(cfg.transport.kind, self.model, w.dtype, bind=host, advertise=host, node_id=node_id,
                                 grpc_cfg=grpc_config(cfg), nixl_cfg=nixl_config(cfg))
        # this process' own endpoint: the inbox's series, and vLLM's engine metrics when the engine
        # is vLLM (they live in the process-wide registry served here)
        from decode_workers.held_kv import HeldPrefixes
        from decode_workers.metrics import worker_registry
        from kvruntime.telemetry import start_exporter
        # the reference engine keeps prefix KV for the next request (vLLM has its own prefix cache)
        held = HeldPrefixes(w.decode_prefix_cache_bytes) if w.decode_engine == "reference" else None
        self.metrics_target = start_exporter(worker_registry(self.receiver, f"decode-{index}", held), host=host)
        if w.decode_engine == "vllm":
            from decode_workers.vllm_engine import VllmDecodeExecutor

            self.executor = VllmDecodeExecutor(
                w.model, dtype=w.dtype, device=device, load_failure_policy=cfg.transport.kv_load_failure_policy,
                receive_timeout=cfg.transport.transfer_timeout_s, receiver=self.receiver, kv_cache_gib=w.vllm_kv_cache_gib,
                max_model_len=w.vllm_max_model_len, threads=w.decode.threads,
                kv_load=w.vllm_kv_load, load_threads=w.vllm_kv_load_threads)
            return
        from decode_workers.executor import DecodeExecutor
        from kvruntime.engine import ReferenceEngine

        self.engine = ReferenceEngine(w.model, dtype=w.dtype, device=device, threads=w.decode.threads)
        self.executor = DecodeExecutor(self.engine, self.receiver, load_failure_policy=cfg.transport.kv_load_failure_policy,
                                       receive_timeout=cfg.transport.transfer_timeout_s, held=held)

    def address(self) -> str:
        return self.receiver.endpoint.grpc_address

    def endpoint(self) -> KVEndpoint:
        """Where and how prefill actors send this actor's KV (NIXL agent metadata included)."""
        return self.receiver.endpoint

    def expect(self, grant: TransferGrant, prefix_ids: tuple[int, ...] = (), salt: str | None = None,
               computes_from: int | None = None) -> int:
        """The router announces a transfer before the prefill actor pushes it. Returns how many
        leading prefix tokens this engine already holds under ``salt`` (vLLM's prefix cache; the
        reference engine's held prefix KV, pinned for this transfer); see :func:`announce`."""
        held, own = announce(self.executor, self.receiver, self.engine_kind, grant, prefix_ids, salt, computes_from)
        if own:
            self._own.add(grant.transfer_id)
        return held

    def inbox_stats(self) -> dict:
        """Inbox accounting: held bytes, refusals by reason, expiries (reads only)."""
        s = self.receiver.stats()
        return {"held_bytes": s.held_bytes, "blocks": s.blocks, "pending": s.pending, "expired": s.expired,
                "refused": s.refused, "rejected": s.rejected, "grants": s.grants, "grants_expired": s.grants_expired,
                "prefix_held": dataclasses.asdict(self.executor.held.stats())
                if getattr(self.executor, "held", None) is not None else None}

    def ready(self) -> dict:
        ep = self.receiver.endpoint
        return {"worker": f"decode-{self.index}", "model": self.model, "engine": self.engine_kind,
                "grpc": ep.grpc_address, "kv_transport": ep.transport, "node_id": ep.node_id,
                "transport_fallback": self.receiver.fallback}

    def health(self) -> dict:
        """Cheap liveness answer (the actor's "health" concurrency group, beside a running
        generate): process id and the gRPC address (new after a restart)."""
        return {"worker": f"decode-{self.index}", "pid": os.getpid(), "grpc": self.receiver.endpoint.grpc_address,
                "metrics": self.metrics_target}

    def cancel(self, key: str) -> None:
        """Stop the generate() call started with ``cancel_key=key`` after its current token
        (deadline passed, client gone). Runs in the "health" group, beside generate."""
        with self._cancel_lock:
            self._cancelled.add(key)

    def generate(self, transfer_id, prefix, suffix, sampling, salt=None, cancel_key=None, continuation=None):
        """Stream a request's tokens (``continuation``: resume one another worker started and lost)."""
        kw = {"continuation": continuation} if continuation is not None else {}
        if transfer_id in self._own:              # no block comes: this engine computes the rest
            self._own.discard(transfer_id)
            gen = self.executor.generate(None, prefix, suffix, sampling, salt=salt, **kw) if self.engine_kind == "vllm" \
                else self.executor.generate(transfer_id, prefix, suffix, sampling, salt=salt, held_only=True, **kw)
        else:
            gen = self.executor.generate(transfer_id, prefix, suffix, sampling, salt=salt, **kw)
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
        if self.engine_kind == "vllm":
            self.executor.stop()
        self.receiver.stop()


def announce(executor, receiver, engine_kind: str, grant: TransferGrant, prefix_ids, salt: str | None,
             computes_from: int | None = None) -> tuple[int, bool]:
    """What ``DecodeWorker.expect`` does: (held leading prefix tokens, whether this engine computes
    the rest of the prefix itself). Held tokens are never built nor sent again:
    - they reach ``computes_from`` (``messages.plan.decode_computes_rest``): no grant is
      registered and no block comes; ``generate`` computes the rest of the prefix in context
      (vLLM: its own prefix cache and a plain prefill; reference: the KV pinned here);
    - otherwise the grant is narrowed to the rest, all the prefill actor then sends. The reference
      engine always gets at least one token sent (the block, with its credential, stays the
      proof the prefill actor built this prefix, and the one receive path is kept)."""
    held = 0
    if prefix_ids and grant.first_position == 0:
        if token_hash(tuple(prefix_ids)) != grant.tokens_sha256 or len(prefix_ids) != grant.tokens:
            raise ValueError(f"prefix ids do not match the grant of transfer {grant.transfer_id}")
        if engine_kind == "vllm":
            held = min(executor.held_prefix(tuple(prefix_ids), salt), grant.tokens)
        else:
            held = executor.held_prefix(tuple(prefix_ids), salt, transfer_id=grant.transfer_id,
                                        limit=grant.tokens - 1, computes_from=computes_from)
        if decode_computes_rest(held, computes_from):
            return held, True
        if held:
            grant = dataclasses.replace(grant, first_position=held, tokens=grant.tokens - held,
                                        tokens_sha256=token_hash(tuple(prefix_ids[held:])))
    receiver.expect(grant)
    return held, False
