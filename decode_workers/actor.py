"""The decode worker as a Ray actor: a decode engine and the KV receiver.

``decode_engine`` in config picks the engine: ``reference`` (torch, the oracle) or ``vllm`` (a
vLLM v1 engine whose kvnotes KV connector writes the received prefix into vLLM's paged cache);
the actor talks to either only through :class:`~decode_workers.engine_api.DecodeEngine`.
Either way the actor owns one :class:`~kvtransport.transfer.endpoints.Receiver` (``kv_transport``: NIXL
and/or gRPC into one inbox that accepts only transfers the router announced with
:meth:`DecodeWorker.expect`). Its gRPC server binds and advertises the node's address as Ray
reports it (127.0.0.1 on a loopback node) or ``bind_host``, so prefill actors on other nodes reach it; :meth:`DecodeWorker.endpoint` (NIXL agent
metadata included) is what the router hands to prefill actors. ``generate`` is a generator
method: the router calls it with ``num_returns="streaming"`` and forwards each token. Every log
line of a call carries its request's id (``kvruntime.request_log``).
Plain class; ``cluster.control.ray_backends`` applies ``ray.remote`` with resources from config.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading

from decode_workers.engine_api import DecodeEngine
from decode_workers.engines import make_decode_engine
from kvruntime import request_log
from kvruntime.config import ClusterConfig
from kvruntime.messages.keys import token_hash
from kvruntime.messages.plan import decode_computes_rest
from kvruntime.messages.decode import DecodeJob, DecodeSummary
from kvruntime.messages.transfer import ExpectReply, KVEndpoint, TransferExpectation

log = logging.getLogger(__name__)


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
        from kvruntime.cpu_priority import lower_priority
        lower_priority(cfg.workers.model_niceness)    # first: the threads started below inherit it (the control plane first)
        from kvtransport.transfer.endpoints import Receiver
        from kvtransport.transfer.options import confine_ucx, grpc_config, nixl_config

        from kvruntime.models import get_model_spec
        request_log.install(worker=True)
        # block headers carry the model's spec name (a checkpoint's <dir>-<content hash>), not the config's path
        self.index, self.model = index, get_model_spec(cfg.workers.model).name
        # this process' start id: its prefix cache is empty after a restart (cluster.control.decode_held)
        self.boot = os.urandom(6).hex()
        self._cancelled: set[str] = set()          # request keys whose deadline passed (cancel())
        self._cancel_lock = threading.Lock()
        from kvruntime.device import resolve_device
        device = resolve_device(cfg.workers.decode.device, "decode")   # auto: cuda when Ray assigned a GPU and torch sees it
        self.device = device
        ip, node_id = node_address()
        host = host or cfg.server.bind_host or ip        # bind_host: kvnotes' listeners bind and advertise it
        confine_ucx(host)                          # NIXL's UCX listens where kvnotes does
        self.receiver = Receiver(cfg.transport.kind, self.model, cfg.workers.dtype, bind=host, advertise=host, node_id=node_id,
                                 grpc_cfg=grpc_config(cfg), nixl_cfg=nixl_config(cfg))
        self.executor: DecodeEngine = make_decode_engine(cfg, self.receiver, device)
        # this process' own endpoint: the inbox's series, and vLLM's engine metrics when the engine
        # is vLLM (they live in the process-wide registry served here)
        from decode_workers.metrics import worker_registry
        from kvruntime.telemetry import start_exporter
        engine = getattr(self.executor, "engine", None) if self.executor.kind == "reference" else None
        copied = (lambda: engine.copied_bytes) if hasattr(engine, "copied_bytes") else None
        self.metrics_target = start_exporter(worker_registry(self.receiver, f"decode-{index}", self.executor.held,
                                                             copied), host=host)
        from kvruntime.startup_heap import freeze_startup_heap
        freeze_startup_heap()      # the engine and inbox live as long as the actor: out of GC's walks

    def endpoint(self) -> KVEndpoint:
        """Where and how prefill actors send this actor's KV (NIXL agent metadata included)."""
        return self.receiver.endpoint

    def expect(self, expectation: TransferExpectation) -> ExpectReply:
        """The router announces a transfer before the prefill actor pushes it. Answers how many
        leading prefix tokens this engine already holds under the plan's salt (vLLM's prefix cache;
        the reference engine's held prefix KV, pinned for this transfer) and whether it computes
        the rest itself; see :func:`announce`."""
        with request_log.bound(_request_of(expectation.grant.transfer_id)):
            return announce(self.executor, self.receiver, expectation)

    def inbox_stats(self) -> dict:
        """Inbox accounting: held bytes, refusals by reason, expiries (reads only)."""
        s = self.receiver.stats()
        return {"held_bytes": s.held_bytes, "blocks": s.blocks, "pending": s.pending, "expired": s.expired,
                "refused": s.refused, "rejected": s.rejected, "grants": s.grants, "grants_expired": s.grants_expired,
                "prefix_held": dataclasses.asdict(self.executor.held.stats())
                if self.executor.held is not None else None}

    def ready(self) -> dict:
        ep = self.receiver.endpoint
        return {"worker": f"decode-{self.index}", "model": self.model, "engine": self.executor.kind,
                "grpc": ep.grpc_address, "kv_transport": ep.transport, "node_id": ep.node_id,
                "transport_fallback": self.receiver.fallback, "device": self.device}

    def health(self) -> dict:
        """Cheap liveness answer (the actor's "health" concurrency group, beside a running
        generate): process id and the gRPC address (new after a restart)."""
        return {"worker": f"decode-{self.index}", "pid": os.getpid(), "grpc": self.receiver.endpoint.grpc_address,
                "metrics": self.metrics_target, "boot": self.boot}

    def cancel(self, key: str) -> None:
        """Stop the generate() call started with ``cancel_key=key`` after its current token
        (deadline passed, client gone). Runs in the "health" group, beside generate."""
        with self._cancel_lock:
            self._cancelled.add(key)

    def generate(self, job: DecodeJob):
        """Stream a request's tokens (``job.continuation``: resume one another worker started and
        lost; every log line of this call carries ``job.request_id``)."""
        with request_log.bound(job.request_id):
            gen = self.executor.generate(job.transfer_id, job.prefix_ids, job.suffix_ids, job.sampling,
                                         salt=job.kv_salt, held_only=job.computes_rest, continuation=job.continuation)
            n, key = 0, job.cancel_key
            try:
                for ev in gen:
                    if key is not None and key in self._cancelled:
                        log.warning("decode-%d: generate stopped after %d token(s): cancelled by the router "
                                    "(deadline passed or client gone)", self.index, n)
                        return                 # the router stops reading and counts it
                    n += 1
                    yield dataclasses.replace(ev, engine=f"decode-{self.index}@{self.boot}") \
                        if isinstance(ev, DecodeSummary) else ev
            except Exception as exc:
                log.error("decode-%d: generate failed after %d token(s): %s", self.index, n, exc)
                raise
            finally:
                gen.close()
                if key is not None:
                    with self._cancel_lock:
                        self._cancelled.discard(key)

    def shutdown(self) -> None:
        self.executor.stop()
        self.receiver.stop()


def _request_of(transfer_id: str) -> str:
    """The request id a transfer id starts with (``<request id>-<8 hex>``, cluster.control.lifecycle)."""
    return transfer_id.rpartition("-")[0] or transfer_id


def announce(executor: DecodeEngine, receiver, expectation: TransferExpectation) -> ExpectReply:
    """What ``DecodeWorker.expect`` does: the held leading prefix tokens, and whether this engine
    computes the rest of the prefix itself (decided here, once). Held tokens are never built nor
    sent again:
    - they reach ``computes_from`` (``messages.plan.decode_computes_rest``): no grant is
      registered and no block comes; ``generate`` computes the rest of the prefix in context
      (vLLM: its own prefix cache and a plain prefill; reference: the KV pinned here);
    - otherwise the grant is narrowed to the rest, all the prefill actor then sends. The reference
      engine always gets at least one token sent (the block, with its credential, stays the
      proof the prefill actor built this prefix, and the one receive path is kept).
    The expectation's ids are the ones its grant was issued from (checked by length when it was
    made: ``TransferExpectation``), so they are not hashed again here."""
    grant, prefix_ids = expectation.grant, expectation.prefix_ids
    held = 0
    if prefix_ids:
        held = executor.hold(grant, prefix_ids, expectation.kv_salt, expectation.computes_from)
        if decode_computes_rest(held, expectation.computes_from):
            return ExpectReply(held, True)
        if held:
            grant = dataclasses.replace(grant, first_position=held, tokens=grant.tokens - held,
                                        tokens_sha256=token_hash(prefix_ids[held:]))
    if executor.receive_room and expectation.room > 0:      # the block lands where the decode session runs
        grant = dataclasses.replace(grant, room=expectation.room)
    receiver.expect(grant)
    return ExpectReply(held, False)
