"""The kvnotes connector's scheduler side (vLLM's engine core calls it; no tensors, no inbox).

A request whose ``kv_transfer_params`` name a kvnotes block
(:func:`decode_workers.vllm_settings.load_params`) reports its first N prompt tokens as
externally matched, minus what vLLM's own prefix cache already holds; after vLLM allocates the
request's blocks, the next step's metadata carries one :class:`LoadSpec` for the worker side.
When the request finishes, what happened to its block (loaded, prefix-cache hit, failed with a
reason the worker side sent back) goes out in ``RequestOutput.kv_transfer_params``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decode_workers.vllm_connector_meta import KvnotesConnectorMetadata, KvnotesWorkerMetadata, LoadSpec
from decode_workers.vllm_settings import (
    PARAM_LOADED,
    PARAM_MODE,
    PARAM_PREFIX,
    PARAM_RESULT,
    PARAM_STAGES,
    PARAM_TRANSFER,
    ConnectorSettings,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass(frozen=True)
class _Allocated:
    """A request's load between vLLM's allocation and the next step's metadata."""
    transfer_id: str
    prefix_tokens: int
    start: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    async_load: bool


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, block_size: int):
        self._mode = settings.kv_load
        self._block_size = block_size
        self._allocated: dict[str, _Allocated] = {}
        self._served: set[str] = set()           # loads handed to the worker (a block is claimed once)
        self._external: dict[str, int] = {}      # req_id -> tokens this connector loads
        self._apc: set[str] = set()              # req_ids whose prefix the prefix cache held whole
        self._failed: dict[str, str] = {}        # req_id -> reason, from worker metadata
        self._stages: dict[str, dict] = {}       # req_id -> worker-side stage seconds

    def _prefix(self, request: "Request") -> int | None:
        """N for a request served from a kvnotes block not yet claimed, else None. vLLM computes
        at least the last prompt token itself (it produces the logits)."""
        params = request.kv_transfer_params or {}
        if PARAM_TRANSFER not in params or request.request_id in self._served:
            return None
        return min(int(params[PARAM_PREFIX]), request.num_prompt_tokens - 1)

    def _is_async(self, request: "Request") -> bool:
        return (request.kv_transfer_params or {}).get(PARAM_MODE, self._mode) == "async"

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self._prefix(request)
        if n is None:
            # a preempted request comes back here: its block was already claimed, so vLLM
            # recomputes (or prefix-cache-hits) the prefix rather than waiting for a block that is gone
            return 0, False
        ext = max(0, n - num_computed_tokens)
        return ext, ext > 0 and self._is_async(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        n = self._prefix(request)
        if n is None:
            return
        rid = request.request_id
        if num_external_tokens <= 0:
            # whole prefix already cached: nothing to write, but the worker still claims (and
            # drops) the block so it does not sit in the inbox until it expires
            self._apc.add(rid)
        self._external[rid] = num_external_tokens
        self._allocated[rid] = _Allocated(request.kv_transfer_params[PARAM_TRANSFER], n, n - num_external_tokens,
                                          tuple(blocks.get_block_ids()[0]), tuple(request.prompt_token_ids[:n]),
                                          self._is_async(request))

    def build_connector_meta(self) -> KvnotesConnectorMetadata:
        meta, bs = KvnotesConnectorMetadata(), self._block_size
        for rid, a in self._allocated.items():
            slots = tuple(a.block_ids[p // bs] * bs + p % bs for p in range(a.start, a.prefix_tokens))
            used = tuple(sorted({a.block_ids[p // bs] for p in range(a.start, a.prefix_tokens)}))
            meta.loads.append(LoadSpec(rid, a.transfer_id, a.prefix_tokens, a.start, slots, used, a.token_ids,
                                       a.async_load))
            self._served.add(rid)
        self._allocated.clear()
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        wm = connector_output.kv_connector_worker_meta
        if wm is None:
            return
        if not isinstance(wm, KvnotesWorkerMetadata):
            raise ValueError(f"the kvnotes connector got worker metadata of type {type(wm).__name__}")
        self._failed.update(wm.failures)
        self._stages.update(wm.stages)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Nothing is held after the request (False); the load's outcome for its output."""
        rid = request.request_id
        self._allocated.pop(rid, None)
        self._served.discard(rid)
        if PARAM_TRANSFER not in (request.kv_transfer_params or {}):
            return False, None
        loaded = self._external.pop(rid, 0)
        if rid in self._failed:
            result, loaded = f"failed:{self._failed.pop(rid)}", 0
        elif rid in self._apc:
            result = "apc"
        else:
            result = "loaded"
        self._apc.discard(rid)
        return False, {PARAM_RESULT: result, PARAM_LOADED: loaded, PARAM_STAGES: self._stages.pop(rid, {})}
