"""The ``workers`` section: what the prefill and decode actors run (model, dtype, decode engine)
and how many of each, with their Ray resources and device. Every actor receives the whole
frozen config; this module imports no torch or Ray (the actor passes in what it sees)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvruntime.config.choices import DecodeEngineKind, ForwardShapes, KVLoadMode

DEVICES = ("auto", "cpu", "cuda")
# every KV block size vLLM uses is a multiple of this (16 on CUDA and for MLA on the CPU, 128 on the CPU
# otherwise, 256 for DeepSeek-V4): vllm_decode_tail is counted in such units
VLLM_BLOCK_UNIT = 16


@dataclass(frozen=True)
class WorkerConfig:
    """One role's actors (``prefill:`` / ``decode:`` in a config file)."""
    count: int = 1                     # actors of this kind
    num_cpus: float = 1.0              # Ray CPUs reserved per actor
    num_gpus: float = 0.0              # Ray GPUs reserved per actor (may be fractional: actors share a GPU)
    device: str = "auto"               # auto: cuda when Ray gave the actor a GPU and torch sees one, else cpu | cpu | cuda
    custom_resource: bool = False      # also require {"prefill": 1} / {"decode": 1} (pin to node types)
    threads: int = 1                   # torch threads inside the actor

    def validate(self, kind: str) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"{kind}.count must be an integer >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.threads < 1:
            raise ValueError(f"{kind}: num_cpus/num_gpus must be >= 0 and threads >= 1")
        if self.device not in DEVICES:
            raise ValueError(f"{kind}.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not self.num_gpus > 0:
            raise ValueError(f"{kind}.device: cuda needs {kind}.num_gpus > 0 (Ray gives the actor its GPU)")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError(f"{kind}: num_gpus > 0 with device: cpu reserves a GPU the actor never uses")


@dataclass(frozen=True)
class WorkersConfig:
    model: str = "smollm2-135m"                # registry name, or a local HF checkpoint directory (kvruntime.hf_models)
    dtype: str = "float32"                     # reference engine weights and KV (tier, wire): float32 | bfloat16 | float16
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    decode_engine: DecodeEngineKind = DecodeEngineKind.REFERENCE  # reference (torch oracle) | vllm (vLLM v1 + kvnotes KV connector)
    few_token_shapes: ForwardShapes = ForwardShapes.EAGER  # reference engine: eager | bucketed (<= 64 new tokens padded
                                               # to 1, 2, 4 .. 64, keys through a length: kvruntime.buckets; eager is the CPU default,
                                               # measured faster there: docs/benchmarks.md section 4)
    grammar_cache_entries: int = 64            # structured outputs: compiled grammars a decode worker keeps (LRU)
    decode_prefix_cache_bytes: int = 256 << 20  # engine=reference: prefix KV a decode actor keeps (LRU) so it is not sent twice; 0 = off
    vllm_kv_cache_bytes: int = 1 << 30         # engine=vllm: paged KV space per decode actor (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB)
    vllm_max_model_len: int = 8192             # engine=vllm: longest prompt + completion (tokens)
    vllm_max_concurrency: int = 16             # engine=vllm: requests one decode actor accepts at once (batched by vLLM)
    vllm_kv_load: KVLoadMode = KVLoadMode.ASYNC  # engine=vllm: async (running streams keep decoding while a block loads) | sync
    vllm_kv_load_threads: int = 2              # engine=vllm, async: blocks claimed, checked and written at once
    # engine=vllm: tokens at the end of a composed prompt's last spliced step the decode engine may compute in
    # context itself (cluster.control.lifecycle.decode_may_compute_from): vLLM's prefix cache keeps whole blocks,
    # so a previous turn composed the same way is held only up to its last whole block, which ends before the
    # splice does; 0 = off (such a turn runs a prefill and sends its block); useful from one block (128 on CPU)
    vllm_decode_tail: int = 128
    max_restarts: int = 5                      # Ray restarts a dead worker actor this often (-1: forever)
    start_timeout_s: float = 600.0             # start_workers gives up (naming the missing resources) after this
    model_niceness: int = 15                   # the worker actors' CPU niceness (Ray's default for every worker): below
                                               # the control plane's (ray_worker_niceness), kvruntime.cpu_priority

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        from kvruntime.models import is_model_name
        if not isinstance(self.model, str) or not is_model_name(self.model):
            raise ValueError(f"model must be a registry name or a checkpoint directory with a config.json, "
                             f"got {self.model!r}")
        for kind in ("prefill", "decode"):
            role = getattr(self, kind)
            if not isinstance(role, WorkerConfig):
                raise ValueError(f"{kind} must be a mapping of WorkerConfig fields")
            role.validate(kind)
        object.__setattr__(self, "decode_engine", DecodeEngineKind.of(self.decode_engine))
        object.__setattr__(self, "few_token_shapes", ForwardShapes.of(self.few_token_shapes))
        if not isinstance(self.grammar_cache_entries, int) or self.grammar_cache_entries < 1:
            raise ValueError("grammar_cache_entries must be an integer >= 1")
        if not isinstance(self.decode_prefix_cache_bytes, int) or self.decode_prefix_cache_bytes < 0:
            raise ValueError("decode_prefix_cache_bytes must be an integer >= 0 (0 = off)")
        if not isinstance(self.vllm_kv_cache_bytes, int) or self.vllm_kv_cache_bytes < 1 << 20:
            raise ValueError(f"vllm_kv_cache_bytes must be an integer >= 1 MiB (1048576), got {self.vllm_kv_cache_bytes!r}")
        if self.vllm_max_model_len < 16 or self.vllm_max_concurrency < 1:
            raise ValueError("vllm_max_model_len >= 16 and vllm_max_concurrency >= 1 required")
        object.__setattr__(self, "vllm_kv_load", KVLoadMode.of(self.vllm_kv_load))
        if not isinstance(self.vllm_kv_load_threads, int) or self.vllm_kv_load_threads < 1:
            raise ValueError("vllm_kv_load_threads must be an integer >= 1")
        self._check_decode_tail()
        if self.max_restarts < -1:
            raise ValueError("worker_max_restarts must be >= -1")
        if self.start_timeout_s <= 0:
            raise ValueError("start_timeout_s must be > 0")
        if not isinstance(self.model_niceness, int) or not 0 <= self.model_niceness <= 19:
            raise ValueError("model_niceness must be an integer from 0 to 19")

    def _check_decode_tail(self) -> None:
        t = self.vllm_decode_tail
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t % VLLM_BLOCK_UNIT or t >= self.vllm_max_model_len:
            raise ValueError(
                f"vllm_decode_tail must be 0 (off) or a positive multiple of {VLLM_BLOCK_UNIT} below vllm_max_model_len "
                f"({self.vllm_max_model_len}), got {t!r}: it is counted in vLLM KV blocks (every vLLM block size is a "
                f"multiple of {VLLM_BLOCK_UNIT}: 16 on CUDA, 128 on the CPU), the tokens past the last whole block "
                "vLLM's prefix cache holds; below the engine's block size (128 on the CPU) it covers that tail only "
                "sometimes")
