"""The kvnotes KV connector for vLLM v1: our composed prefix KV enters vLLM's paged cache.

vLLM loads it with ``kv_transfer_config={"kv_connector": "KvnotesConnector",
"kv_connector_module_path": "decode_workers.vllm_connector", ...}``
(:func:`decode_workers.vllm_adapter.build_engine`). Like vLLM's own NixlConnector, the class
vLLM instantiates is a facade: vLLM builds one per role, and it forwards each call to its
role's half.

* **Scheduler side** (:class:`~decode_workers.vllm_connector_scheduler.ConnectorScheduler`):
  a request carrying ``kv_transfer_params={"kvnotes_transfer_id": ID, "kvnotes_prefix_tokens": N}``
  reports its first N prompt tokens as externally matched, minus what vLLM's own prefix cache
  (APC) already holds. APC stays on: the suffix after our prefix is computed by vLLM and cached
  by it, and a repeated prefix hits APC without a transfer.
* **Worker side** (:class:`~decode_workers.vllm_connector_worker.ConnectorWorker`): claims each
  request's block from the decode actor's inbox, checks it and writes each layer with the
  attention backend's own ``do_kv_cache_update`` op.

Settings arrive in ``kv_connector_extra_config``
(:class:`~decode_workers.vllm_settings.ConnectorSettings`). A block that is missing, late or
corrupt is reported to vLLM as failed blocks; vLLM's ``kv_load_failure_policy`` (ours, passed
through: ``recompute`` or ``fail``) then recomputes the prefix or fails the request. The reason
travels back to the scheduler side as worker metadata and out in
``RequestOutput.kv_transfer_params["kvnotes_load"]`` so the decode worker counts it.

**Load mode** (``kvnotes_kv_load``; per request in its ``kv_transfer_params``): ``async``
(default) uses vLLM's asynchronous load: the request waits in ``WAITING_FOR_REMOTE_KVS`` while
the engine keeps stepping the running requests, a pool of ``kvnotes_load_threads`` threads
claims, checks and writes the block (:mod:`decode_workers.vllm_async_load`, which also says why
the write is safe), and ``get_finished`` reports it. ``sync`` loads before the step's forward,
which stalls every running request on this engine for the claim, the checks and the copy (kept
to measure the difference: ``python -m bench.decode_stall``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from decode_workers.vllm_adapter import check_version
from decode_workers.vllm_connector_meta import KvnotesWorkerMetadata
from decode_workers.vllm_connector_scheduler import ConnectorScheduler
from decode_workers.vllm_connector_worker import ConnectorWorker
from decode_workers.vllm_settings import ConnectorSettings
from kvtransport.transfer.interface import KVReceiver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvnotesConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        check_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(settings, vllm_config.cache_config.block_size)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ConnectorWorker(settings)
        else:
            raise ValueError(f"unknown KV connector role {role!r}")

    def _scheduler(self) -> ConnectorScheduler:
        if self.connector_scheduler is None:
            raise ValueError("a scheduler-side call reached the worker-side kvnotes connector")
        return self.connector_scheduler

    def _worker(self) -> ConnectorWorker:
        if self.connector_worker is None:
            raise ValueError("a worker-side call reached the scheduler-side kvnotes connector")
        return self.connector_worker

    @property
    def inbox(self) -> KVReceiver:
        """The inbox the worker side claims blocks from."""
        return self._worker().inbox

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta()

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker().start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return      # whole blocks load before (sync) or off (async) the forward, never per layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return      # decode side only: kvnotes saves KV on the prefill workers

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvnotesWorkerMetadata | None:
        return self._worker().build_worker_meta()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
