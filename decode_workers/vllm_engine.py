"""vLLM as the decode engine: the same ``generate`` contract as
:class:`~decode_workers.executor.DecodeExecutor`, served by a vLLM v1 ``LLMEngine``.

The prefix KV arrives through the kvnotes connector (:mod:`decode_workers.vllm_connector`),
whose worker side claims from this decode actor's inbox (registered in
:data:`decode_workers.vllm_inbox.INBOXES` under a key the connector's extra config carries).
vLLM's automatic prefix caching stays on. Every request carries a ``cache_salt`` so vLLM's
prefix cache never hands KV composed by kvnotes (re-rotated, edited: close to but not bit-equal
with a full prefill) to a request that asked for exact KV, or across tenants: exact prompts are
salted by tenant only, composed prefixes additionally by their plan's recipe
(:meth:`kvruntime.messages.plan.RequestPlan.kv_salt`). What this module needs of vLLM beyond
its public API goes through :mod:`decode_workers.vllm_adapter`.

One engine per actor, stepped by one background thread; ``generate`` may be called from many
threads at once (a threaded Ray actor), which is what lets vLLM batch concurrent requests.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Iterator

from decode_workers import vllm_adapter
from decode_workers.engine_api import DecodeEngine
from decode_workers.vllm_async_load import on_load_done
from decode_workers.vllm_inbox import INBOXES
from decode_workers.vllm_settings import ConnectorSettings, VllmEngineConfig, load_params
from decode_workers.vllm_stream import DecodeStream
from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from kvtransport.transfer.endpoints import Receiver

log = logging.getLogger(__name__)

_KV_WAIT_S = 0.05     # the step loop's wait while only async loads are pending (their end wakes it)


class VllmDecodeExecutor(DecodeEngine):
    """vLLM's decode engine (:class:`~decode_workers.engine_api.DecodeEngine`): its prefix cache
    holds KV between requests, its connector receives the blocks. ``receiver``: the decode
    actor's inbox (None: the connector serves a gRPC inbox of its own at ``address``)."""
    kind = "vllm"

    def __init__(self, config: VllmEngineConfig, receiver: "Receiver | None" = None):
        if not isinstance(config, VllmEngineConfig):
            raise ValueError(f"VllmDecodeExecutor takes a VllmEngineConfig, got {type(config).__name__}")
        vllm_adapter.prepare_process(config)           # vLLM's environment, then the pinned version
        from kvruntime.checkpoint import ensure_checkpoint
        from kvruntime.hf_models import eos_token_ids
        from kvruntime.models import get_model_spec
        from kvtransport.tier.server import free_port

        self.config, self.spec = config, get_model_spec(config.model)
        self.policy, self.kv_load = config.load_failure_policy, config.kv_load   # generate(kv_load=) overrides
        ckpt = ensure_checkpoint(self.spec)
        self._inbox_key = INBOXES.register(receiver) if receiver is not None else ""
        port = 0 if receiver is not None else (config.grpc_port or free_port(config.grpc_host))
        settings = ConnectorSettings(self.spec.name, config.receive_timeout_s, config.kv_load, config.load_threads,
                                     self._inbox_key, config.grpc_host, port)
        t = time.perf_counter()
        try:      # the checkpoint directory itself (a registry model: its converted one); never past the model's window
            self.engine = vllm_adapter.build_engine(config, str(ckpt), min(config.max_model_len, self.spec.context_window),
                                                    settings.to_extra())
            self.core = vllm_adapter.InprocCore(self.engine)
        except BaseException:
            INBOXES.release(self._inbox_key)
            raise
        self.address = receiver.endpoint.grpc_address if receiver is not None else f"{config.grpc_host}:{port}"
        self.block_size = self.core.block_size          # prefix-cache granularity (tokens)
        # the reference engine's stop set (vLLM alone stops at the generation config's EOS only)
        self.eos_ids = frozenset(eos_token_ids(self.engine.get_tokenizer(), _generation_config(ckpt)))
        log.info("vLLM decode engine for %s up in %.1f s; KV inbox %s", self.spec.name, time.perf_counter() - t,
                 self.address)
        self._work = threading.Condition(threading.Lock())
        self._queues: dict[str, queue.Queue] = {}
        self._stopped = False
        self._hurry = 0            # steps to run without waiting: a load ended (reported, then scheduled)
        self._unhook = on_load_done(self._load_done)
        self._thread = threading.Thread(target=self._loop, name="vllm-step", daemon=True)
        self._thread.start()

    # ---- the step loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        vllm_adapter.set_threads(self.config.threads)     # per thread: this one steps the engine
        while True:
            with self._work:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._work.wait()
                if self._stopped:
                    return
                if self.core.only_waiting_for_kv() and not self._hurry:
                    # only requests waiting for their KV (an async load): nothing to compute; a load's
                    # end wakes this (vllm_async_load.on_load_done), the timeout is a safety net
                    self._work.wait(_KV_WAIT_S)
                self._hurry = max(0, self._hurry - 1)
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

    def _load_done(self) -> None:
        """An async load ended: the next step reports it, the one after schedules its request."""
        with self._work:
            self._hurry = 2
            self._work.notify()

    def stop(self) -> None:
        self._unhook()
        with self._work:
            self._stopped = True
            self._work.notify_all()
        self._thread.join(timeout=10)
        INBOXES.release(self._inbox_key)

    def held_prefix(self, prefix_ids: tuple[int, ...], salt: str | None = None) -> int:
        """Leading tokens of ``prefix_ids`` whose KV vLLM's prefix cache holds now under ``salt``
        (whole blocks): the part a prefill worker need not send. A lookup only (no allocation, no
        stats); the cache may evict before the request is scheduled, and the connector then
        reports the block as unusable (recompute, counted)."""
        with self._work:                                   # not while the step loop is inside a step
            return self.core.cached_prefix_tokens(tuple(prefix_ids), salt)

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
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the decode worker computes the last logits)")
        done = continuation.tokens if continuation is not None else ()
        if len(done) >= sampling.max_tokens:               # it had ended; only the summary was lost
            yield DecodeSummary(len(done), "length", (), 0.0, continuation.text)
            return
        if done:
            suffix_ids = tuple(suffix_ids) + tuple(done)
            sampling = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(done))
        block = None if held_only or transfer_id is None or not prefix_ids else \
            load_params(transfer_id, len(prefix_ids), kv_load or self.kv_load)
        stream = DecodeStream(sampling, self.eos_ids, start=len(done), text=continuation.text if continuation else "")
        rid, q = self._submit(tuple(prefix_ids) + tuple(suffix_ids), salt,
                              vllm_adapter.request_sampling(sampling, self.eos_ids, block))
        try:
            while True:
                out = q.get()
                if isinstance(out, Exception):
                    raise RuntimeError(f"vLLM engine failed: {out}") from out
                yield from stream.events(out)
                if out.finished:
                    stream.close(out, expected_block=block is not None, policy=self.policy)
                    break
        finally:
            self._abort_unfinished(rid)
        yield stream.summary()

    def _submit(self, prompt_ids: tuple[int, ...], salt: str | None, vs) -> tuple[str, queue.Queue]:
        """Add the request to the engine; its outputs arrive on the returned queue."""
        prompt = {"prompt_token_ids": list(prompt_ids), **({"cache_salt": salt} if salt else {})}
        rid, q = uuid.uuid4().hex, queue.Queue()
        with self._work:
            self._queues[rid] = q
            self.engine.add_request(rid, prompt, vs)
            self._work.notify()
        return rid, q

    def _abort_unfinished(self, rid: str) -> None:
        """A stream closed before vLLM finished it (the caller stopped reading) is aborted."""
        with self._work:
            if self._queues.pop(rid, None) is not None:
                self.engine.abort_request([rid])


def _generation_config(ckpt):
    """The checkpoint's generation_config.json, or None where it has none."""
    import transformers
    try:
        return transformers.GenerationConfig.from_pretrained(str(ckpt))
    except OSError:
        return None
