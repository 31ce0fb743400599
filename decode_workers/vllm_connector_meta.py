"""What the kvnotes connector's two sides tell each other through vLLM, once per step:
:class:`KvnotesConnectorMetadata` (scheduler -> worker: the loads to run) and
:class:`KvnotesWorkerMetadata` (worker -> scheduler: failed loads, stage times)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """One request's load in one step (scheduler -> worker)."""
    req_id: str
    transfer_id: str
    prefix_tokens: int              # N: the block holds prompt tokens [0, N)
    start: int                      # first token to write (tokens before it are prefix-cache hits)
    slot_mapping: tuple[int, ...]   # [N - start] paged slot of tokens start..N-1
    block_ids: tuple[int, ...]      # vLLM block ids those slots live in (reported on failure)
    token_ids: tuple[int, ...]      # [N] the request's prompt tokens 0..N-1 (the block must hold exactly these)
    async_load: bool = False        # True: vLLM waits for get_finished (WAITING_FOR_REMOTE_KVS)

    @property
    def nothing_to_write(self) -> bool:
        """The prefix cache holds the whole prefix: the block is only claimed and dropped."""
        return self.start >= self.prefix_tokens


@dataclass
class KvnotesConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class KvnotesWorkerMetadata(KVConnectorWorkerMetadata):
    failures: dict[str, str] = field(default_factory=dict)     # req_id -> reason label
    stages: dict[str, dict] = field(default_factory=dict)      # req_id -> {"receive": s, "load": s}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvnotesWorkerMetadata):
            raise ValueError(f"cannot merge kvnotes worker metadata with {type(other).__name__}")
        return KvnotesWorkerMetadata({**self.failures, **other.failures}, {**self.stages, **other.stages})
