"""The kvnotes connector's worker side (vLLM's model runner calls it, around each forward).

It claims each request's block from the decode actor's ``Receiver`` (NIXL and/or gRPC into
one granted inbox, found by key in :data:`decode_workers.vllm_inbox.INBOXES`) or, without one
(a bare engine), from a gRPC inbox of its own; checks it (CRC, model, token ids, positions in
order) and writes each layer into vLLM's paged cache
(:class:`decode_workers.vllm_adapter.PagedCacheWriter`). Async loads run on
:class:`~decode_workers.vllm_async_load.AsyncLoader`'s threads; sync ones before the forward.
A failed load's blocks go to vLLM as load errors and its reason back to the scheduler side.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from decode_workers import vllm_adapter
from decode_workers.vllm_async_load import AsyncLoader
from decode_workers.vllm_connector_meta import KvnotesConnectorMetadata, KvnotesWorkerMetadata, LoadSpec
from decode_workers.vllm_inbox import INBOXES
from decode_workers.vllm_settings import ConnectorSettings
from kvtransport.transfer.blocks import BlockError, decode_block
from kvtransport.transfer.interface import KVReceiver, TransferError

log = logging.getLogger(__name__)


class _Mismatch(ValueError):
    """The block is intact but not the KV this request's prompt needs."""


def _reason(exc: Exception) -> str:
    """The fallback label of a failed load (``kvnotes_fallbacks_total{reason}``)."""
    if isinstance(exc, TransferError):
        return exc.reason if exc.reason.startswith("kv_") else f"kv_transfer_{exc.reason}"
    return "kv_block_invalid" if isinstance(exc, BlockError) else "kv_mismatch"


class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings):
        self._model = settings.model
        self._timeout = float(settings.receive_timeout_s)
        self._mode = settings.kv_load
        self._owns_inbox = not settings.inbox_key
        if self._owns_inbox:
            from kvtransport.transfer.grpc_transport import GrpcTransport
            own = GrpcTransport(model=self._model)
            self.address: str | None = own.serve(settings.grpc_host, settings.grpc_port)
            self.inbox: KVReceiver = own
        else:
            self.inbox, self.address = INBOXES.get(settings.inbox_key), None   # the actor's: its address is its own
        self._lock = threading.Lock()
        self._failures: dict[str, str] = {}
        self._stages: dict[str, dict] = {}
        self._invalid: set[int] = set()
        self._specs: dict[str, LoadSpec] = {}          # loads started and not yet reported (under _lock)
        self._layer_names: list[str] = []
        self._writer: vllm_adapter.PagedCacheWriter | None = None   # at the first load (needs the forward context)
        self._async = AsyncLoader(settings.load_threads, self._lock, self._fail_locked)
        log.info("kvnotes connector: receiving KV blocks at %s (default load %s)",
                 self.address or "the decode actor's inbox", self._mode)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layer_names = vllm_adapter.layer_order(kv_caches)

    def start_load_kv(self, meta: KvnotesConnectorMetadata, forward_context) -> None:
        if not isinstance(meta, KvnotesConnectorMetadata):
            raise ValueError(f"the kvnotes connector got step metadata of type {type(meta).__name__}")
        if meta.loads and self._writer is None:
            self._writer = vllm_adapter.PagedCacheWriter(forward_context, self._layer_names)
        for spec in meta.loads:
            report = spec.async_load and not spec.nothing_to_write
            if report or not spec.async_load:
                with self._lock:
                    self._specs[spec.req_id] = spec
            if spec.async_load or (self._mode == "async" and spec.nothing_to_write):
                # a prefix the cache holds whole (nothing to write, nobody waits) is claimed and dropped off the step too
                self._async.submit(spec.req_id, lambda spec=spec: self._try_load(spec), report=report)
                continue
            reason = self._try_load(spec)
            with self._lock:
                if reason is not None:
                    self._fail_locked(spec.req_id, reason)
                self._specs.pop(spec.req_id, None)

    def _try_load(self, spec: LoadSpec) -> str | None:
        """Load ``spec``; None, or the failure reason (logged)."""
        try:
            self._load(spec)
            return None
        except (TransferError, BlockError, _Mismatch) as exc:
            reason = _reason(exc)
            log.warning("kvnotes: KV for request %s (transfer %s) unusable: %s: %s",
                        spec.req_id, spec.transfer_id, reason, exc)
            return reason

    def _fail_locked(self, req_id: str, reason: str) -> None:
        """Record a failed load (caller holds ``self._lock``): its blocks go to vLLM as load errors."""
        spec = self._specs.pop(req_id, None)
        self._failures[req_id] = reason
        if spec is not None:
            self._invalid.update(spec.block_ids)

    def _load(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        if spec.nothing_to_write:
            try:
                self.inbox.receive(spec.transfer_id, timeout=self._timeout)
            except TransferError as exc:               # nothing was needed from it: not a fallback
                log.info("kvnotes: unneeded block %s not claimed: %s", spec.transfer_id, exc)
            return
        block = self.inbox.receive(spec.transfer_id, timeout=self._timeout)
        t1 = time.perf_counter()
        kv = decode_block(block, model=self._model)
        del block
        self._write(spec, kv)
        with self._lock:
            self._stages[spec.req_id] = {"receive": t1 - t0, "load": time.perf_counter() - t1}

    def _write(self, spec: LoadSpec, kv) -> None:
        """Check ``kv`` covers tokens [start, N) of the request's prompt, then write them."""
        n = spec.prefix_tokens
        # the block holds tokens [f, N): f > 0 when the sender skipped what this engine's prefix
        # cache held at grant time (``held_prefix``); it must still cover [start, n)
        f = int(kv.positions[0]) if kv.num_tokens else n
        if f > spec.start or kv.num_tokens < n - f or not torch.equal(kv.positions[:n - f], torch.arange(f, n)):
            raise _Mismatch(f"block holds {kv.num_tokens} tokens from position {f}; tokens {spec.start}..{n - 1} "
                            f"are needed")
        if tuple(kv.token_ids[:n - f].tolist()) != spec.token_ids[f:n]:
            raise _Mismatch("block token ids differ from the request's prompt")
        writer = self._writer
        if kv.data.shape[0] != len(writer.layers):
            raise _Mismatch(f"block has {kv.data.shape[0]} layers, model has {len(writer.layers)}")
        slots = torch.tensor(spec.slot_mapping, dtype=torch.long, device=writer.device)
        for i in range(len(writer.layers)):
            # ours: [2, kv_heads, tokens, head_dim] -> vLLM's op wants [tokens, kv_heads, head_dim]
            k, v = (kv.data[i, j, :, spec.start - f:n - f].transpose(0, 1) for j in (0, 1))
            writer.write(i, k, v, slots)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending: never, this side only receives; finished receiving)."""
        done = self._async.take_done()
        with self._lock:
            for rid in done:
                self._specs.pop(rid, None)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def build_worker_meta(self) -> KvnotesWorkerMetadata | None:
        with self._lock:
            if not self._failures and not self._stages:
                return None
            out = KvnotesWorkerMetadata(self._failures, self._stages)
            self._failures, self._stages = {}, {}
        return out

    def shutdown(self) -> None:
        self._async.shutdown()
        if self._owns_inbox:                  # a decode actor's Receiver is its own to stop
            self.inbox.stop()
