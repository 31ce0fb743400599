"""vLLM as the decode engine: the same ``generate`` contract as
:class:`~decode_workers.executor.DecodeExecutor`, served by a vLLM v1 ``LLMEngine``.

The prefix KV arrives through the kvnotes connector (:mod:`decode_workers.vllm_connector`),
whose worker side owns this decode worker's gRPC inbox. vLLM's automatic prefix caching stays
on. Every request carries a ``cache_salt`` so vLLM's prefix cache never hands KV composed by
kvnotes (re-rotated, edited: close to but not bit-equal with a full prefill) to a request
that asked for exact KV, or across tenants: exact prompts are salted by tenant only, composed
prefixes additionally by their plan's recipe (:meth:`kvruntime.messages.plan.RequestPlan.kv_salt`).

One engine per actor, stepped by one background thread; ``generate`` may be called from many
threads at once (a threaded Ray actor), which is what lets vLLM batch concurrent requests.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from typing import Iterator

import torch

from decode_workers.engine_api import DecodeEngine
from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent

_set_num_threads = torch.set_num_threads   # kept before vLLM's CPU worker replaces it with a no-op

log = logging.getLogger(__name__)

CONNECTOR = "KvnotesConnector"
CONNECTOR_MODULE = "decode_workers.vllm_connector"


def _guard_llvmlite_for_vllm() -> None:
    """vLLM 0.32's CPU start-up rebinds kernels by scanning every imported module's globals and
    calls ``vars(obj).get`` on each object with a ``__dict__``. llvmlite's ``ffi.lib`` wrapper
    (loaded with numba, e.g. by LMCache) answers *any* attribute, ``__dict__`` included, with a
    function wrapper, so the scan crashes (``'_lib_fn_wrapper' object has no attribute 'get'``).
    ctypes' own CDLL refuses dunder names; make llvmlite's wrapper do the same."""
    import sys
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_kvnotes_guarded", False):
        return
    original = wrapper.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._kvnotes_guarded = True


class VllmDecodeExecutor(DecodeEngine):
    """vLLM's decode engine (:class:`~decode_workers.engine_api.DecodeEngine`): its prefix cache
    holds KV between requests, its connector receives the blocks."""
    kind = "vllm"

    def __init__(self, model: str, *, dtype: str = "float32", device: str = "cpu",
                 load_failure_policy: str = "recompute", receive_timeout: float = 30.0,
                 grpc_host: str = "127.0.0.1", grpc_port: int | None = None, receiver=None,
                 kv_cache_gib: float = 1.0, max_model_len: int = 8192, enable_prefix_caching: bool = True,
                 threads: int = 1, kv_load: str = "async", load_threads: int = 2):
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        if kv_load not in ("async", "sync") or load_threads < 1:
            raise ValueError("kv_load must be 'async' or 'sync' and load_threads >= 1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core (and our connector's gRPC server) live here
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        _set_num_threads(threads)
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig

        from kvruntime.checkpoint import ensure_checkpoint
        from kvruntime.models import get_model_spec
        from kvtransport.tier.server import free_port

        self.spec = get_model_spec(model)
        self.policy = load_failure_policy
        self.kv_load = kv_load        # default load mode of this engine's requests (generate(kv_load=) overrides)
        port = grpc_port or free_port(grpc_host)
        ckpt = ensure_checkpoint(self.spec)
        self._receiver_key = ""
        if receiver is not None:       # the decode actor's Receiver: the connector (same process) claims from it
            from decode_workers.vllm_connector import RECEIVERS
            self._receiver_key = uuid.uuid4().hex
            RECEIVERS[self._receiver_key] = receiver
        ktc = KVTransferConfig(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_consumer",
            kv_load_failure_policy=load_failure_policy,
            kv_connector_extra_config={"kvnotes_model": self.spec.name, "kvnotes_grpc_host": grpc_host,
                                       "kvnotes_grpc_port": port, "kvnotes_receive_timeout_s": receive_timeout,
                                       "kvnotes_receiver": self._receiver_key, "kvnotes_kv_load": kv_load,
                                       "kvnotes_load_threads": load_threads})
        # the checkpoint directory itself (a registry model: its converted one); never past the model's window
        args = EngineArgs(model=str(ckpt), tokenizer=str(ckpt), dtype=dtype, enforce_eager=True,
                          enable_prefix_caching=enable_prefix_caching,
                          max_model_len=min(max_model_len, self.spec.context_window),
                          kv_transfer_config=ktc, disable_log_stats=False, seed=0)
        t = time.perf_counter()
        _guard_llvmlite_for_vllm()
        self.engine = LLMEngine.from_engine_args(args)
        self.address = receiver.endpoint.grpc_address if receiver is not None else f"{grpc_host}:{port}"
        self.block_size = self.engine.vllm_config.cache_config.block_size   # APC granularity (tokens)
        # the reference engine's stop set (vLLM alone stops at the generation config's EOS only)
        from kvruntime.hf_models import eos_token_ids
        self.eos_ids = eos_token_ids(self.engine.get_tokenizer(), _generation_config(ckpt))
        log.info("vLLM decode engine for %s up in %.1f s; KV inbox %s", self.spec.name, time.perf_counter() - t,
                 self.address)
        self._threads = threads
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, queue.Queue] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vllm-step", daemon=True)
        self._thread.start()

    # ---- the step loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        # OpenMP thread counts are per thread, and vLLM's CPU worker replaces torch.set_num_threads
        # with a no-op after binding: set this thread's count with the original, to what the
        # engine was built with (its attention plan checks the two agree).
        _set_num_threads(self._threads)
        while True:
            with self._work:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._work.wait()
                if self._stopped:
                    return
                if self._idle():
                    # only requests waiting for their KV (an async load): nothing to compute, so poll
                    # the loads' completion gently instead of spinning on empty steps
                    self._work.wait(0.002)
                try:
                    outs = self.engine.step()
                except Exception as exc:           # an engine failure ends every request with it
                    log.exception("vLLM step failed")
                    for q in self._queues.values():
                        q.put(exc)
                    self._queues.clear()
                    continue
                for out in outs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put(out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)

    def _idle(self) -> bool:
        """True when vLLM's scheduler has nothing running (in-process engine core only)."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        sched = getattr(core, "scheduler", None)
        return sched is not None and not sched.running and len(getattr(sched, "kv_holding_waiting", ())) > 0 \
            and not len(getattr(sched, "waiting", ()))

    def stop(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify_all()
        self._thread.join(timeout=10)
        if self._receiver_key:
            from decode_workers.vllm_connector import RECEIVERS
            RECEIVERS.pop(self._receiver_key, None)

    def held_prefix(self, prefix_ids: tuple[int, ...], salt: str | None = None) -> int:
        """Leading tokens of ``prefix_ids`` whose KV vLLM's prefix cache holds now under ``salt``
        (whole blocks): the part a prefill worker need not send. A lookup only (no allocation, no
        stats); the cache may evict before the request is scheduled, and the connector then
        reports the block as unusable (recompute, counted)."""
        from vllm import SamplingParams as VSampling
        from vllm.v1.request import Request

        core = getattr(self.engine.engine_core, "engine_core", None)      # in-process engine core only
        hasher = getattr(core, "request_block_hasher", None)
        if hasher is None or len(prefix_ids) < self.block_size:
            return 0
        with self._work:                                   # not while the step loop is inside a step
            probe = Request("kvnotes-apc-probe", list(prefix_ids), VSampling(max_tokens=1), None, cache_salt=salt,
                            block_hasher=hasher)
            _, hit, _ = core.scheduler.kv_cache_manager.coordinator.find_longest_cache_hit(
                probe.block_hashes, len(prefix_ids))
        return int(hit)

    def hold(self, grant, prefix_ids: tuple[int, ...], salt: str | None, computes_from: int | None = None) -> int:
        """What the prefix cache holds now (nothing is pinned: see :meth:`held_prefix`)."""
        return min(self.held_prefix(tuple(prefix_ids), salt), grant.tokens)

    # ---- requests -----------------------------------------------------------------------------
    def generate(self, transfer_id: str | None, prefix_ids: tuple[int, ...], suffix_ids: tuple[int, ...],
                 sampling: SamplingParams, *, salt: str | None = None, held_only: bool = False,
                 kv_load: str | None = None,
                 continuation: Continuation | None = None) -> Iterator[TokenEvent | DecodeSummary]:
        """Yields one :class:`TokenEvent` per generated token, then a :class:`DecodeSummary`.
        ``transfer_id`` None or ``held_only``: no block comes, vLLM computes (or APC-hits) the
        prefix itself.
        ``kv_load``: async | sync for this request's block (None: the engine's ``kv_load``).
        ``continuation``: the streamed tokens join the prompt and ``max_tokens`` shrinks by them;
        event indices and the summary continue the stream. vLLM's sampler starts afresh there, so
        the continuation equals an undisturbed run for greedy requests without penalties; seeded
        draws, presence / frequency penalties and a stop string spanning the boundary do not carry
        over (the reference engine carries all of them)."""
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind

        from decode_workers.vllm_connector import PARAM_LOADED, PARAM_RESULT, PARAM_STAGES, load_params

        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the decode worker computes the last logits)")
        if held_only:
            transfer_id = None
        done = continuation.tokens if continuation is not None else ()
        if continuation is not None:
            if len(done) >= sampling.max_tokens:               # it had ended; only the summary was lost
                yield DecodeSummary(len(done), "length", (), 0.0, continuation.text)
                return
            suffix_ids = tuple(suffix_ids) + tuple(done)
            sampling = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(done))
        extra = {"kv_transfer_params": load_params(transfer_id, len(prefix_ids), kv_load or self.kv_load)} \
            if transfer_id is not None and prefix_ids else None
        vs = VSampling(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                       seed=sampling.seed, stop=list(sampling.stop) or None, output_kind=RequestOutputKind.DELTA,
                       presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                       logit_bias=dict(sampling.logit_bias) or None, logprobs=sampling.logprobs,
                       stop_token_ids=sorted(self.eos_ids), structured_outputs=_structured(sampling),
                       extra_args=extra)
        prompt = {"prompt_token_ids": list(prefix_ids) + list(suffix_ids)}
        if salt:
            prompt["cache_salt"] = salt
        rid = uuid.uuid4().hex
        q: queue.Queue = queue.Queue()
        t = time.perf_counter()
        with self._work:
            self._queues[rid] = q
            self.engine.add_request(rid, prompt, vs)
            self._work.notify()
        n, text, finish, fallbacks, first, cached, loaded, stages = (len(done), continuation.text if continuation else "",
                                                                     "length", [], None, 0, 0, {})
        try:
            while True:
                out = q.get()
                if isinstance(out, Exception):
                    raise RuntimeError(f"vLLM engine failed: {out}") from out
                c = out.outputs[0]
                lps = list(c.logprobs or []) if sampling.logprobs is not None else []
                toks = [(t, lps[j] if j < len(lps) else None) for j, t in enumerate(c.token_ids)
                        if t not in self.eos_ids]   # like the reference: EOS ends, is not emitted
                for j, (tok, lp) in enumerate(toks):
                    first = first if first is not None else time.perf_counter() - t
                    # the delta text arrives once per output; attach it to its last token
                    yield TokenEvent(tok, c.text if j == len(toks) - 1 else "", n, *_logprobs(tok, lp, sampling))
                    n += 1
                text += c.text
                if out.num_cached_tokens is not None:
                    cached = max(cached, out.num_cached_tokens)
                if out.finished:
                    params = out.kv_transfer_params or {}
                    result, loaded = params.get(PARAM_RESULT, ""), int(params.get(PARAM_LOADED, 0))
                    stages = dict(params.get(PARAM_STAGES) or {})
                    if result.startswith("failed:"):
                        fallbacks.append(result.split(":", 1)[1])
                    if c.finish_reason == "error":
                        # policy 'fail': vLLM ends the request before the worker's reason reaches
                        # the scheduler side (the connector logs it), so the label is generic
                        reason = fallbacks[-1] if fallbacks else ("kv_load_failed" if extra else "engine error")
                        raise RuntimeError(f"prefix KV unavailable ({reason}) and kv load failure policy is "
                                           f"'{self.policy}'")
                    finish = "stop" if c.finish_reason == "stop" else "length"
                    break
        finally:
            with self._work:
                if self._queues.pop(rid, None) is not None:
                    self.engine.abort_request([rid])
        if first is not None:
            stages["first_token"] = first
        yield DecodeSummary(n, finish, tuple(fallbacks), first or 0.0, text, cached, loaded, tuple(stages.items()))


def _structured(sampling: SamplingParams):
    """The request's constraint as vLLM's own structured-output parameters (None without one):
    JSON without free whitespace, no unnamed properties when strict (as the reference engine)."""
    c = sampling.constraint
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams
    if c.kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return StructuredOutputsParams(json=c.schema, disable_any_whitespace=True, disable_additional_properties=c.strict)


def _generation_config(ckpt):
    """The checkpoint's generation_config.json, or None where it has none."""
    import transformers
    try:
        return transformers.GenerationConfig.from_pretrained(str(ckpt))
    except OSError:
        return None


def _logprobs(tok: int, lp, sampling: SamplingParams) -> tuple[float | None, tuple[tuple[int, float], ...]]:
    """vLLM's per-token ``{token id: Logprob(logprob, rank, ...)}`` as (sampled log-prob, top k)."""
    if lp is None:
        return None, ()
    top = sorted(((i, float(x.logprob)) for i, x in lp.items() if x.rank is not None and x.rank <= sampling.logprobs),
                 key=lambda p: -p[1])
    return (float(lp[tok].logprob) if tok in lp else None), tuple(top[:sampling.logprobs])
