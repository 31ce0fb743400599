"""The vLLM decode engine's typed settings, and the vocabulary its connector speaks (torch- and
vLLM-free: importable anywhere).

* :class:`VllmEngineConfig`: what :class:`~decode_workers.vllm_engine.VllmDecodeExecutor` is
  built from, one frozen value (:meth:`VllmEngineConfig.from_cluster` reads ``ClusterConfig``).
* :class:`ConnectorSettings`: what the engine tells the kvnotes connector vLLM builds, written
  into and read back from vLLM's ``kv_connector_extra_config`` (the only channel vLLM gives a
  connector's constructor), each key validated once, with a ``ValueError`` naming it.
* The ``kv_transfer_params`` keys a request carries in (:func:`load_params`) and the connector
  answers with in ``RequestOutput.kv_transfer_params``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvruntime.config.choices import KVLoadMode, LoadFailurePolicy


# a request's kv_transfer_params, in
PARAM_TRANSFER = "kvnotes_transfer_id"   # the block pushed for this request
PARAM_PREFIX = "kvnotes_prefix_tokens"   # N: the block holds prompt tokens [0, N)
PARAM_MODE = "kvnotes_kv_load"           # "async" | "sync" (absent: the engine's)
# RequestOutput.kv_transfer_params of a finished request, out
PARAM_RESULT = "kvnotes_load"            # "loaded" | "apc" | "failed:<reason>"
PARAM_LOADED = "kvnotes_loaded_tokens"   # prefix tokens the connector wrote (the rest hit vLLM's prefix cache)
PARAM_STAGES = "kvnotes_stages"          # {"receive": s, "load": s} measured on the worker side


def load_params(transfer_id: str, prefix_tokens: int, mode: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a request carries to be served from a kvnotes block (``mode``:
    async | sync, None = the engine's ``kv_load``)."""
    if prefix_tokens < 1:
        raise ValueError("prefix_tokens must be >= 1")
    out: dict[str, Any] = {PARAM_TRANSFER: transfer_id, PARAM_PREFIX: int(prefix_tokens)}
    if mode is not None:
        out[PARAM_MODE] = KVLoadMode.of(mode, "kv_load").value
    return out


@dataclass(frozen=True)
class VllmEngineConfig:
    """One vLLM decode engine (one per decode actor process)."""
    model: str                           # registry name or checkpoint directory (kvruntime.models)
    dtype: str = "float32"               # vLLM's weights and paged KV
    device: str = "cpu"                  # cpu | cuda
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE   # vLLM's kv_load_failure_policy
    receive_timeout_s: float = 30.0      # how long the connector waits for a request's block
    grpc_host: str = "127.0.0.1"         # the connector's own inbox (no receiver given) binds here
    grpc_port: int = 0                   # ... on this port (0: a free one)
    kv_cache_gib: float = 1.0            # paged KV space (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB)
    max_model_len: int = 8192            # tokens, prompt + completion (capped at the model's window)
    enable_prefix_caching: bool = True   # vLLM's automatic prefix cache
    threads: int = 1                     # torch / OpenMP threads of the step loop
    kv_load: KVLoadMode = KVLoadMode.ASYNC   # default load mode of a request's block
    load_threads: int = 2                # async loads claimed, checked and written at once

    def __post_init__(self):
        # a member from ClusterConfig, or a string from a test / bench: checked once, by its Choice
        object.__setattr__(self, "load_failure_policy", LoadFailurePolicy.of(self.load_failure_policy))
        object.__setattr__(self, "kv_load", KVLoadMode.of(self.kv_load, "kv_load"))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for name, value in (("threads", self.threads), ("load_threads", self.load_threads),
                            ("max_model_len", self.max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.kv_cache_gib > 0 or not self.receive_timeout_s > 0:
            raise ValueError("kv_cache_gib and receive_timeout_s must be > 0")
        if not isinstance(self.grpc_port, int) or not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be 0 (a free port) or a TCP port, got {self.grpc_port!r}")

    @classmethod
    def from_cluster(cls, cfg, device: str) -> "VllmEngineConfig":
        """The engine a decode actor of ``cfg`` (a ``ClusterConfig``) runs on ``device``."""
        w = cfg.workers
        return cls(model=w.model, dtype=w.dtype, device=device,
                   load_failure_policy=cfg.transport.kv_load_failure_policy,
                   receive_timeout_s=cfg.transport.transfer_timeout_s, kv_cache_gib=w.vllm_kv_cache_bytes / 2**30,
                   max_model_len=w.vllm_max_model_len, threads=w.decode.threads, kv_load=w.vllm_kv_load,
                   load_threads=w.vllm_kv_load_threads)


# kv_connector_extra_config keys (ConnectorSettings <-> vLLM)
_EXTRA = {"model": "kvnotes_model", "receive_timeout_s": "kvnotes_receive_timeout_s", "kv_load": "kvnotes_kv_load",
          "load_threads": "kvnotes_load_threads", "inbox_key": "kvnotes_inbox_key",
          "grpc_host": "kvnotes_grpc_host", "grpc_port": "kvnotes_grpc_port"}


@dataclass(frozen=True)
class ConnectorSettings:
    """What the kvnotes connector needs, both roles. ``inbox_key``: the decode actor's
    ``Receiver`` registered in :data:`decode_workers.vllm_inbox.INBOXES` (same process); empty:
    the worker side serves its own gRPC inbox on ``grpc_host:grpc_port``."""
    model: str                 # registry name; blocks of another model are refused
    receive_timeout_s: float
    kv_load: KVLoadMode
    load_threads: int
    inbox_key: str = ""
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{_EXTRA['model']} must name the model, got {self.model!r}")
        object.__setattr__(self, "kv_load", KVLoadMode.of(self.kv_load, _EXTRA["kv_load"]))
        if not isinstance(self.load_threads, int) or self.load_threads < 1:
            raise ValueError(f"{_EXTRA['load_threads']} must be an integer >= 1, got {self.load_threads!r}")
        if not isinstance(self.receive_timeout_s, (int, float)) or not self.receive_timeout_s > 0:
            raise ValueError(f"{_EXTRA['receive_timeout_s']} must be > 0, got {self.receive_timeout_s!r}")
        if not isinstance(self.inbox_key, str):
            raise ValueError(f"{_EXTRA['inbox_key']} must be a string, got {self.inbox_key!r}")
        if not self.inbox_key and not (isinstance(self.grpc_port, int) and 0 < self.grpc_port < 65536):
            raise ValueError(f"without {_EXTRA['inbox_key']} the connector serves its own inbox: "
                             f"{_EXTRA['grpc_port']} must be a TCP port, got {self.grpc_port!r}")

    def to_extra(self) -> dict[str, Any]:
        values = {**dataclasses.asdict(self), "kv_load": self.kv_load.value}    # plain JSON values
        return {key: values[name] for name, key in _EXTRA.items()}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        """Read back what :meth:`to_extra` wrote; a missing key is a ``ValueError`` naming it."""
        extra = extra or {}
        required = ("model", "receive_timeout_s", "kv_load", "load_threads")
        missing = [_EXTRA[n] for n in required if _EXTRA[n] not in extra]
        if missing:
            raise ValueError(f"kv_connector_extra_config lacks {', '.join(missing)} (the kvnotes connector is "
                             f"configured by decode_workers.vllm_engine.VllmDecodeExecutor)")
        return cls(**{name: extra[key] for name, key in _EXTRA.items() if key in extra})
