"""The kvnotes KV connector for vLLM v1: our composed prefix KV enters vLLM's paged cache.

vLLM loads it with ``kv_transfer_config={"kv_connector": "KvnotesConnector",
"kv_connector_module_path": "decode_workers.vllm_connector", ...}``. Two halves, one class:

* **Scheduler side.** A request that carries ``kv_transfer_params={"kvnotes_transfer_id": ID,
  "kvnotes_prefix_tokens": N}`` reports its first N prompt tokens as externally matched, minus
  what vLLM's own prefix cache (APC) already holds. APC stays on: the suffix after our prefix
  is computed by vLLM and cached by it, and a repeated prefix hits APC without a transfer.
* **Worker side.** Claims blocks from the decode actor's :class:`~kvtransport.transfer.endpoints.Receiver`
  (NIXL and/or gRPC into one granted inbox), found in :data:`RECEIVERS` under the extra config's
  ``kvnotes_receiver`` key (vLLM runs in the actor's process); without one it serves its own
  gRPC inbox on ``kvnotes_grpc_host:kvnotes_grpc_port``. Before the forward pass it claims each request's block,
  checks it (CRC, model, token ids, positions 0..N-1 in order) and writes each layer with the
  attention backend's own ``do_kv_cache_update`` op: the paged layout is never sliced by hand.

A block that is missing, late or corrupt is reported to vLLM as failed blocks; vLLM's
``kv_load_failure_policy`` (ours, passed through: ``recompute`` or ``fail``) then recomputes
the prefix or fails the request. The reason travels back to the scheduler side as worker
metadata and out in ``RequestOutput.kv_transfer_params["kvnotes_load"]`` so the decode worker
counts it.

**Load mode** (extra config ``kvnotes_kv_load``, per request ``kvnotes_kv_load`` in its
``kv_transfer_params``): ``async`` (default) uses vLLM's asynchronous load: the request waits
in ``WAITING_FOR_REMOTE_KVS`` while the engine keeps stepping the running requests, a pool of
``kvnotes_load_threads`` threads claims, checks and writes the block
(:mod:`decode_workers.vllm_async_load`, which also says why the write is safe), and
``get_finished`` reports it. ``sync`` loads before the step's forward, which stalls every running
request on this engine for the claim, the checks and the copy (kept to measure the difference:
``python -m bench.decode_stall``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index

from decode_workers.vllm_async_load import AsyncLoader
from kvtransport.transfer.blocks import BlockError, decode_block
from kvtransport.transfer.interface import TransferError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PARAM_TRANSFER = "kvnotes_transfer_id"
PARAM_PREFIX = "kvnotes_prefix_tokens"
PARAM_RESULT = "kvnotes_load"       # in RequestOutput.kv_transfer_params: "loaded" | "apc" | "failed:<reason>"
PARAM_LOADED = "kvnotes_loaded_tokens"   # ... and how many prefix tokens the connector wrote (the rest hit APC)
PARAM_STAGES = "kvnotes_stages"          # ... and {"receive": s, "load": s} measured on the worker side
PARAM_MODE = "kvnotes_kv_load"           # in a request's kv_transfer_params: "async" | "sync" (else the engine's)
LOAD_MODES = ("async", "sync")

#: receivers owned by decode actors in this process, by key (``kvnotes_receiver`` in extra config)
RECEIVERS: dict[str, Any] = {}


@dataclass(frozen=True)
class LoadSpec:
    """One request's load in one step (scheduler -> worker)."""
    req_id: str
    transfer_id: str
    prefix_tokens: int          # N: the block holds prompt tokens [0, N)
    start: int                  # first token to write (tokens before it are APC hits)
    slot_mapping: tuple[int, ...]   # [N - start] paged slot of tokens start..N-1
    block_ids: tuple[int, ...]      # vLLM block ids those slots live in (reported on failure)
    token_ids: tuple[int, ...]      # [N] the request's prompt tokens 0..N-1 (the block must hold exactly these)
    async_load: bool = False        # True: vLLM waits for get_finished (WAITING_FOR_REMOTE_KVS)


@dataclass
class KvnotesConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class KvnotesWorkerMetadata(KVConnectorWorkerMetadata):
    failures: dict[str, str] = field(default_factory=dict)     # req_id -> reason label
    stages: dict[str, dict] = field(default_factory=dict)      # req_id -> {"receive": s, "load": s}

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, KvnotesWorkerMetadata)
        return KvnotesWorkerMetadata({**self.failures, **other.failures}, {**self.stages, **other.stages})


def load_params(transfer_id: str, prefix_tokens: int, mode: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a request carries to be served from a kvnotes block (``mode``:
    async | sync, None = the engine's ``kvnotes_kv_load``)."""
    if prefix_tokens < 1:
        raise ValueError("prefix_tokens must be >= 1")
    if mode is not None and mode not in LOAD_MODES:
        raise ValueError(f"kv load mode must be async or sync, got {mode!r}")
    return {PARAM_TRANSFER: transfer_id, PARAM_PREFIX: int(prefix_tokens), **({PARAM_MODE: mode} if mode else {})}


class KvnotesConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block_size = vllm_config.cache_config.block_size
        self._model = extra.get("kvnotes_model")          # registry name; blocks of another model are refused
        self._timeout = float(extra.get("kvnotes_receive_timeout_s", 30.0))
        self._mode = extra.get("kvnotes_kv_load", "async")
        if self._mode not in LOAD_MODES:
            raise ValueError(f"kvnotes_kv_load must be async or sync, got {self._mode!r}")
        # scheduler side
        self._pending: dict[str, tuple] = {}    # req_id -> (tid, N, start, blocks, ids, async)
        self._failed: dict[str, str] = {}                 # req_id -> reason, from worker metadata
        self._loaded: set[str] = set()
        self._external: dict[str, int] = {}               # req_id -> tokens this connector loads
        self._served: set[str] = set()                    # loads already handed to the worker (a block is claimed once)
        self._stage_times: dict[str, dict] = {}           # req_id -> worker-side stage seconds
        # worker side
        self.transport = None
        self.address: str | None = None
        self._failures: dict[str, str] = {}
        self._stages: dict[str, dict] = {}
        self._invalid: set[int] = set()
        self._layer_names: list[str] = []
        self._layers: list | None = None                  # attention layers, in layer order (first start_load_kv)
        self._lock = threading.Lock()
        self._owns_transport = False
        self._async: AsyncLoader | None = None
        self._specs: dict[str, LoadSpec] = {}             # loads started and not yet reported (under _lock)
        if role == KVConnectorRole.WORKER:
            self.transport = RECEIVERS.get(extra.get("kvnotes_receiver", ""))
            if self.transport is None:
                from kvtransport.transfer.grpc_transport import GrpcTransport
                self.transport, self._owns_transport = GrpcTransport(model=self._model), True
                host = extra.get("kvnotes_grpc_host", "127.0.0.1")
                self.address = self.transport.serve(host, int(extra.get("kvnotes_grpc_port", 0)))
            else:
                self.address = self.transport.endpoint.grpc_address
            self._async = AsyncLoader(int(extra.get("kvnotes_load_threads", 2)), self._lock, self._fail_locked)
            log.info("kvnotes connector: receiving KV blocks at %s (default load %s)", self.address, self._mode)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if PARAM_TRANSFER not in params or request.request_id in self._served:
            # a preempted request comes back here: its block was already claimed, so vLLM
            # recomputes (or APC-hits) the prefix rather than waiting for a block that is gone
            return 0, False
        n = int(params[PARAM_PREFIX])
        if n >= request.num_prompt_tokens:
            # vLLM must compute at least the last prompt token itself (it produces the logits)
            n = request.num_prompt_tokens - 1
        ext = max(0, n - num_computed_tokens)
        return ext, ext > 0 and params.get(PARAM_MODE, self._mode) == "async"

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if PARAM_TRANSFER not in params or request.request_id in self._served:
            return
        n = min(int(params[PARAM_PREFIX]), request.num_prompt_tokens - 1)
        if num_external_tokens <= 0:
            # whole prefix already in APC: nothing to write, but the worker still claims (and
            # drops) the block so it does not sit in the inbox until it expires
            self._loaded.add(request.request_id)
        start = n - num_external_tokens
        self._external[request.request_id] = num_external_tokens
        self._pending[request.request_id] = (params[PARAM_TRANSFER], n, start, list(blocks.get_block_ids()[0]),
                                             tuple(request.prompt_token_ids[:n]),
                                             params.get(PARAM_MODE, self._mode) == "async")

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvnotesConnectorMetadata()
        for req_id, (tid, n, start, block_ids, ids, async_load) in self._pending.items():
            bs = self._block_size
            slots = tuple(block_ids[p // bs] * bs + p % bs for p in range(start, n))
            used = tuple(sorted({block_ids[p // bs] for p in range(start, n)}))
            meta.loads.append(LoadSpec(req_id, tid, n, start, slots, used, ids, async_load))
            self._served.add(req_id)
        self._pending.clear()
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KvnotesWorkerMetadata):
            self._failed.update(wm.failures)
            self._stage_times.update(wm.stages)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._pending.pop(rid, None)
        self._served.discard(rid)
        if PARAM_TRANSFER not in params:
            return False, None
        loaded = self._external.pop(rid, 0)
        if rid in self._failed:
            result, loaded = f"failed:{self._failed.pop(rid)}", 0
        elif rid in self._loaded:
            result = "apc"
        else:
            result = "loaded"
        self._loaded.discard(rid)
        return False, {PARAM_RESULT: result, PARAM_LOADED: loaded, PARAM_STAGES: self._stage_times.pop(rid, {})}

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._layer_names = sorted(kv_caches, key=extract_layer_index)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvnotesConnectorMetadata)
        if meta.loads and self._layers is None:
            self._layers = [forward_context.no_compile_layers[name] for name in self._layer_names]
        for spec in meta.loads:
            report = spec.async_load and spec.start < spec.prefix_tokens
            if report or not spec.async_load:
                with self._lock:
                    self._specs[spec.req_id] = spec
            if spec.async_load or (self._mode == "async" and spec.start >= spec.prefix_tokens):
                # an APC-held prefix (nothing to write, nobody waits) is claimed and dropped off the step too
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
            reason = exc.reason if isinstance(exc, TransferError) else \
                ("kv_block_invalid" if isinstance(exc, BlockError) else "kv_mismatch")
            log.warning("kvnotes: KV for request %s (transfer %s) unusable: %s: %s",
                        spec.req_id, spec.transfer_id, reason, exc)
            return reason if reason.startswith("kv_") else f"kv_transfer_{reason}"

    def _fail_locked(self, req_id: str, reason: str) -> None:
        """Record a failed load (caller holds ``self._lock``): its blocks go to vLLM as load errors."""
        spec = self._specs.pop(req_id, None)
        self._failures[req_id] = reason
        if spec is not None:
            self._invalid.update(spec.block_ids)

    def _load(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        if spec.start >= spec.prefix_tokens:          # APC holds it all: claim and drop the block
            try:
                self.transport.receive(spec.transfer_id, timeout=self._timeout)
            except TransferError as exc:               # nothing was needed from it: not a fallback
                log.info("kvnotes: unneeded block %s not claimed: %s", spec.transfer_id, exc)
            return
        block = self.transport.receive(spec.transfer_id, timeout=self._timeout)
        t1 = time.perf_counter()
        kv = decode_block(block, model=self._model)
        del block
        n = spec.prefix_tokens
        # the block holds tokens [f, N): f > 0 when the sender skipped what this engine's prefix
        # cache held at grant time (``held_prefix``); it must still cover [start, n)
        f = int(kv.positions[0]) if kv.num_tokens else n
        if f > spec.start or kv.num_tokens < n - f or not torch.equal(kv.positions[:n - f], torch.arange(f, n)):
            raise _Mismatch(f"block holds {kv.num_tokens} tokens from position {f}; tokens {spec.start}..{n - 1} "
                            f"are needed")
        if tuple(kv.token_ids[:n - f].tolist()) != spec.token_ids[f:n]:
            raise _Mismatch("block token ids differ from the request's prompt")
        layers = self._layers
        if kv.data.shape[0] != len(layers):
            raise _Mismatch(f"block has {kv.data.shape[0]} layers, model has {len(layers)}")
        first = layers[0]
        slots = torch.tensor(spec.slot_mapping, dtype=torch.long, device=first.kv_cache.device)
        for i, layer in enumerate(layers):
            cache = layer.kv_cache
            # ours: [2, kv_heads, tokens, head_dim] -> vLLM's op wants [tokens, kv_heads, head_dim]:
            # a transposed view where the op honours strides (no copy), else one contiguous copy
            k, v = (kv.data[i, j, :, spec.start - f:n - f].transpose(0, 1) for j in (0, 1))
            if not (_strided_ok(layer.impl) and k.dtype == cache.dtype and k.device == cache.device):
                k, v = (t.to(cache.device, cache.dtype).contiguous() for t in (k, v))
            layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
        with self._lock:
            self._stages[spec.req_id] = {"receive": t1 - t0, "load": time.perf_counter() - t1}

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return      # decode side only: kvnotes saves KV on the prefill workers

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._async.take_done() if self._async is not None else set()
        with self._lock:
            for rid in done:
                self._specs.pop(rid, None)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KvnotesWorkerMetadata | None:
        with self._lock:
            if not self._failures and not self._stages:
                return None
            out = KvnotesWorkerMetadata(self._failures, self._stages)
            self._failures, self._stages = {}, {}
        return out

    def shutdown(self):
        if self._async is not None:
            self._async.shutdown()
        if self.transport is not None and self._owns_transport:   # a decode actor's Receiver is its own to stop
            self.transport.stop()


def _strided_ok(impl) -> bool:
    """Whether ``impl.do_kv_cache_update`` takes strided key/value views: vLLM's CPU backend
    (``cpu_attn_reshape_and_cache`` reads each token/head by stride; checked against the
    contiguous input in tests/test_vllm_decode.py). GPU ops assume [heads, head_dim] contiguous
    per token, so they get a copy."""
    return type(impl).__name__ == "CPUAttentionBackendImpl"


class _Mismatch(ValueError):
    pass
