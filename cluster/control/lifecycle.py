"""One request's execution after planning, in stages, each a function of the request's
:class:`~cluster.control.context.RequestContext` and its :class:`PlannedRequest`:

1. **place**: a live decode worker and a live prefill worker (503 ``no_live_worker`` when none);
2. **grant**: the transfer's grant and credential, the decode worker told what to expect
   (:class:`~kvruntime.messages.transfer.TransferExpectation`); it answers how much of the prefix
   it holds and whether it computes the rest itself (:class:`~kvruntime.messages.transfer.ExpectReply`);
3. **prefill**: the prefill worker builds and pushes the rest (a :class:`~kvruntime.messages.prefill.PrefillJob`),
   told to stop past the deadline or when the client leaves (:mod:`cluster.control.cancel`);
4. **decode**: the tokens streamed (a :class:`~kvruntime.messages.decode.DecodeJob`), continued on
   another decode worker when its own is lost mid-stream (:mod:`cluster.control.migration`);
5. **account**: what *executed* recorded (TTFT and requests by it, prompt tokens by source,
   transfer bytes, stage seconds, fallbacks) in :class:`~cluster.control.metrics.Metrics`.

A worker lost before the first token: the whole request retried elsewhere (``request_retries``).
Every error maps to a status in one table (:data:`FAILURES`). The router plans
(:mod:`cluster.control.planner`); the runner executes the plan it is given and never re-plans: a lost
or refused block becomes the decode worker's counted recompute, not a new plan. It talks to workers
only through the ``Backends`` protocol (:mod:`cluster.control.backends`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator

from cluster.control.cancel import prefill_or_cancel
from cluster.control.context import RequestContext, StageClock
from cluster.control.errors import RequestError
from cluster.control.metrics import CACHED_SOURCES, Metrics, prompt_sources
from cluster.control.migration import DecodeStream
from cluster.control.routing import DeadlineExceeded, FaultPolicy, NoLiveWorker, WorkerLost, WorkerView
from kvruntime.config.workers import WorkersConfig
from kvruntime.messages.decode import DecodeJob, DecodeSummary, SamplingParams, TokenEvent, TokenLogprob
from kvruntime.messages.plan import KVRef, PlanKind, RequestPlan
from kvruntime.messages.prefill import PrefillJob, PrefillResult
from kvruntime.messages.transfer import STAGES, ExpectReply, TransferExpectation, TransferGrant

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.shadow import FidelityGuard

__all__ = ["Finished", "PlannedRequest", "RequestRunner", "StageClock", "FAILURES"]

log = logging.getLogger(__name__)
# Fallbacks after which the request still executed as planned: only storing its KV failed, the KV
# was built in ordinary memory because the NIXL send pool was full (the send copied it), or the
# block travelled over gRPC instead of NIXL (and arrived: a lost block adds its own reason)
STORE_ONLY_FALLBACKS = frozenset({"tier_store_failed", "kv_send_pool_full", "kv_transport_nixl_unavailable",
                                  "kv_transport_nixl_to_grpc"})


@dataclass(frozen=True)
class Finished:
    """Last event of a request: what the API layer needs for ``usage`` and ``explain``."""
    plan: RequestPlan
    summary: DecodeSummary
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int             # prompt tokens nobody computed for this request (metrics.CACHED_SOURCES)
    fallbacks: tuple[str, ...]
    stored: bool = False           # the prefix KV was stored in the tier for the next request
    stages: tuple[tuple[str, float], ...] = ()   # KV path seconds per stage (transfer.STAGES order)
    transport: str = ""            # what carried the prefix KV (nixl | grpc; "" if none was sent)
    sources: tuple[tuple[str, int], ...] = ()   # prompt tokens by where their KV came from (metrics.prompt_sources)
    clock: StageClock | None = None  # control-path laps (explain.control), None outside an HTTP request
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # plan.prompt_logprobs: prompt tokens 1.. (the prefill's rows)


@dataclass(frozen=True)
class PlannedRequest:
    """What the router hands the runner: the plan and everything decided with it."""
    plan: RequestPlan
    sampling: SamplingParams
    store_as: KVRef | None         # store the built prefix under this key (None: don't)
    prefill_index: int             # the prefill worker the router picked (and looked the tier up on)
    salt: str                      # the tenant's salt
    started: float                 # perf_counter when the router took the request (TTFT's origin)

    @property
    def kind(self) -> str:
        return self.plan.kind.value


@dataclass
class _Run:
    """One run's progress across attempts (mutable; lives for one ``RequestRunner.run``)."""
    deadline: float                                   # perf_counter time
    kv_salt: str                                      # plan.kv_salt(salt): a pass over every prefix token, once
    prefill_index: int
    tried: dict = field(default_factory=lambda: {"prefill": set(), "decode": set()})
    attempt: int = 0
    sent: int = 0                                     # tokens streamed to the client
    ttft: float | None = None
    result: PrefillResult | None = None
    summary: DecodeSummary | None = None


# tokens at the end of an approximate plan's last spliced step the decode engine may compute in context
# itself (vLLM's CPU block: what a previous turn composed the same way leaves unheld, in its last partial
# block): the config key ``vllm_decode_tail`` (kvruntime.config.workers, checked there), its default here
DECODE_TAIL = WorkersConfig.vllm_decode_tail


def decode_may_compute_from(plan: RequestPlan, tail: int = DECODE_TAIL) -> int:
    """The ``computes_from`` of the decode worker's expectation: the plan's ``forward_from``; for
    an approximate plan continuing at least ``tail`` tokens past it (``vllm_decode_tail``; 0: never),
    up to that many tokens before it (never before its last loading step's start; a repeat of a composed prompt
    keeps its composed KV, so it answers as the first did). A decode engine holding the previous turn of a conversation composed the same way
    (its cache holds it under the same recipe salt, in whole blocks) then computes the rest itself,
    the unheld tail of the spliced chunk included, in context: no less faithful than the splice, and
    no prefill, no transfer, as plain vLLM would continue the conversation."""
    end = plan.forward_from
    if not tail or not plan.approx or not end or plan.prompt_tokens - end < tail:
        return end          # a prompt that does not continue past its composition (a repeat): as composed
    start = pos = 0
    for s in plan.steps:
        if s.kind not in (PlanKind.RECOMPUTE, PlanKind.ERRATUM):
            start = pos
        pos += s.tokens
    return max(start + 1, end - tail)


# exception -> (status label of kvnotes_requests_total, HTTP status, error code); None: raised unchanged
FAILURES: dict[type, tuple[str, int | None, str | None]] = {
    NoLiveWorker: ("no_live_worker", 503, "no_live_worker"),
    DeadlineExceeded: ("deadline", 504, "deadline_exceeded"),
    WorkerLost: ("worker_lost", 503, "worker_lost"),
    RequestError: ("client_error", None, None),
}
_OTHER = ("error", None, None)


class RequestRunner:
    def __init__(self, backends: "Backends", view: WorkerView, fault: FaultPolicy, metrics: Metrics, dtype: str,
                 guard: "FidelityGuard", default_tenant: str, decode_tail: int = DECODE_TAIL):
        self.backends, self.view, self.fault, self.metrics = backends, view, fault, metrics
        self.dtype, self.guard, self.default_tenant = dtype, guard, default_tenant
        self.decode_tail = decode_tail           # vllm_decode_tail (decode_may_compute_from)

    async def run(self, ctx: RequestContext, job: PlannedRequest) -> AsyncIterator[TokenEvent | Finished]:
        """The stages (module doc), retried on another worker when one is lost before the first
        token; past the deadline or with the client gone the worker at work is told to stop."""
        ctx.outcome.planned(job.kind)              # the edge's label for it if it is abandoned
        deadline = job.started + min(ctx.deadline_s or self.fault.deadline_s, self.fault.deadline_s)
        run = _Run(deadline, job.plan.kv_salt(job.salt), job.prefill_index)
        while True:
            try:
                async with aclosing(self._attempt(ctx, job, run)) as events:   # closed with the caller's
                    async for ev in events:
                        yield ev
                break
            except WorkerLost as exc:
                if not self._retry(job, run, exc):
                    self._fail(ctx, job, run, exc)
            except Exception as exc:
                self._fail(ctx, job, run, exc)
        yield self.account(ctx, job, run)

    async def _attempt(self, ctx: RequestContext, job: PlannedRequest, run: _Run) -> AsyncIterator[TokenEvent]:
        """One try on one pair of workers: place, grant, prefill, decode."""
        decode_index = self.place(job, run)
        transfer_id = f"{job.plan.request_id}-{uuid.uuid4().hex[:8]}"
        self.view.begin("decode", decode_index, job.sampling.max_tokens)
        try:
            reply, result = ExpectReply(0, False), None
            if job.plan.steps:
                reply, result = await self._build(ctx, job, run, decode_index, transfer_id)
            run.result = result
            sent = reply.computes_rest or (result is not None and result.transferred)
            djob = DecodeJob(job.plan.request_id, transfer_id if sent else None, job.plan.prefix_ids,
                             job.plan.suffix_ids, job.sampling, run.kv_salt, reply.computes_rest, transfer_id)
            async with aclosing(self.decode(ctx, job, run, decode_index, djob)) as events:
                async for ev in events:
                    yield ev
        finally:
            self.view.end("decode", decode_index, job.sampling.max_tokens)

    # ---- 1. place -----------------------------------------------------------------------------
    def place(self, job: PlannedRequest, run: _Run) -> int:
        """A live decode worker (returned) and a live prefill worker (``run.prefill_index``): the
        router's pick unless this request lost it."""
        decode_index = self.view.pick_decode(exclude=run.tried["decode"])
        if run.prefill_index in run.tried["prefill"] or not self.view.is_alive("prefill", run.prefill_index):
            run.prefill_index = self.view.pick_prefill(None, exclude=run.tried["prefill"])
        return decode_index

    async def _build(self, ctx: RequestContext, job: PlannedRequest, run: _Run, decode_index: int,
                     transfer_id: str) -> tuple[ExpectReply, PrefillResult | None]:
        """Stages 2 and 3 with the prefill worker's load counted on it."""
        prefill_index, tokens = run.prefill_index, job.plan.prompt_tokens
        self.view.begin("prefill", prefill_index, tokens)
        ctx.leases.release()                     # the pick's reservation becomes this call's load
        try:
            reply, credential = await self.grant(ctx, job, run, decode_index, transfer_id)
            if reply.computes_rest:
                return reply, None
            pjob = PrefillJob(job.plan, transfer_id, credential, job.store_as, reply.held)
            return reply, await self.prefill(ctx, job, run, decode_index, pjob)
        finally:
            self.view.end("prefill", prefill_index, tokens)

    # ---- 2. grant -----------------------------------------------------------------------------
    async def grant(self, ctx: RequestContext, job: PlannedRequest, run: _Run, decode_index: int,
                    transfer_id: str) -> tuple[ExpectReply, str]:
        """The decode worker accepts this block only: credential (the prefill worker's alone), shape,
        dtype. Ship nothing twice: it says how much of the prefix it holds; build nothing twice:
        holding up to the plan's ``forward_from`` it computes the rest itself and no prefill runs
        (not for a session's context to store)."""
        plan = job.plan
        grant, credential = TransferGrant.issue(transfer_id, plan.model, self.dtype, plan.prefix_ids)
        computes_from = None if (job.store_as is not None and plan.session) or plan.prompt_logprobs is not None \
            else decode_may_compute_from(plan, self.decode_tail)  # prompt log-probs: the prefill worker's rows
        ctx.lap("grant")
        reply = await self._before(run.deadline, "prefill", self.backends.expect(
            decode_index, TransferExpectation(grant, plan.prefix_ids, run.kv_salt, computes_from,
                                              len(plan.suffix_ids) + job.sampling.max_tokens)))
        ctx.lap("expect_call")
        return reply, credential

    # ---- 3. prefill ---------------------------------------------------------------------------
    async def prefill(self, ctx: RequestContext, job: PlannedRequest, run: _Run, decode_index: int,
                      pjob: PrefillJob) -> PrefillResult:
        """Build and push the prefix; past the deadline or with the client gone the prefill worker
        is told to stop."""
        index = run.prefill_index
        result = await prefill_or_cancel(self.backends, self.metrics, index, pjob.transfer_id, job.plan.request_id,
                                         self._before(run.deadline, "prefill",
                                                      self.backends.prefill(index, decode_index, pjob)))
        ctx.lap("prefill_call")
        ctx.add("prefill_build", result.seconds)       # what the prefill actor itself measured of that call
        ctx.add("prefill_send", sum(v for k, v in result.stats.stages.items() if k in ("serialise", "transfer")))
        return result

    # ---- 4. decode ----------------------------------------------------------------------------
    async def decode(self, ctx: RequestContext, job: PlannedRequest, run: _Run, decode_index: int,
                     djob: DecodeJob) -> AsyncIterator[TokenEvent]:
        """The decode worker's tokens (continued elsewhere when it is lost mid-stream, told to stop
        past the deadline or when the client leaves); its summary kept in ``run.summary``."""
        stream = DecodeStream(self.backends, self.view, self.fault, self.metrics, djob, job.plan.prompt_tokens,
                              run.tried["decode"], lambda aw: self._before(run.deadline, "decode", aw))
        try:
            async for ev in stream.events(decode_index):
                if not isinstance(ev, TokenEvent):
                    run.summary = ev
                    continue
                if run.ttft is None and run.result is not None and run.result.stats.prompt_logprobs:
                    ev = replace(ev, prompt_logprobs=tuple(run.result.stats.prompt_logprobs))   # on the first
                if run.ttft is None:               # observed in account(), labelled with what executed
                    run.ttft = time.perf_counter() - job.started
                    ctx.first_token()              # out of the admission queue (a service sample)
                    ctx.lap("decode_call")
                    if ctx.clock is not None:
                        ctx.clock.first_token = time.perf_counter()
                run.sent += 1
                yield ev
        except (GeneratorExit, asyncio.CancelledError):
            stream.abandon()
            raise
        finally:
            stream.close()

    # ---- retries and failures ---------------------------------------------------------------------
    def _retry(self, job: PlannedRequest, run: _Run, exc: WorkerLost) -> bool:
        """Whether a lost worker is retried elsewhere (before the first token, within ``request_retries``)."""
        run.tried[exc.role].add(exc.index)
        if run.sent or run.attempt >= self.fault.retries:
            self.metrics.retries.labels(exc.role, "lost_mid_stream" if run.sent else "retries_exhausted").inc()
            return False
        run.attempt += 1
        self.metrics.retries.labels(exc.role, "lost_before_first_token").inc()
        log.warning("request %s: %s before its first token; retrying on another worker (%d/%d)",
                    job.plan.request_id, exc, run.attempt, self.fault.retries)
        return True

    def _fail(self, ctx: RequestContext, job: PlannedRequest, run: _Run, exc: Exception):
        """Count the request by its status (:data:`FAILURES`) and raise what the caller sees."""
        status, code, error = next((v for t, v in FAILURES.items() if isinstance(exc, t)), _OTHER)
        self.metrics.count_request(job.kind, status, record=ctx.outcome)
        if isinstance(exc, DeadlineExceeded):
            self.metrics.deadlines.labels(exc.stage).inc()
            log.warning("request %s: deadline passed during %s; worker told to stop", job.plan.request_id, exc.stage)
        elif isinstance(exc, WorkerLost):
            log.error("request %s failed: %s (%s after %d tokens)", job.plan.request_id, exc,
                      "lost_mid_stream" if run.sent else "retries_exhausted", run.sent)
            if run.sent:
                raise WorkerLost(exc.role, exc.index, f"{exc.reason} mid-stream after {run.sent} tokens; the answer "
                                 "is incomplete, send the request again") from None
            raise RequestError(code, f"{exc}; retried {run.attempt} time(s) without success, send the request "
                                     "again", code=error) from None
        if code is None:
            raise exc
        raise RequestError(code, str(exc), code=error) from None

    # ---- 5. account ---------------------------------------------------------------------------
    def account(self, ctx: RequestContext, job: PlannedRequest, run: _Run) -> Finished:
        """Record what executed (not what was planned) and build the request's last event."""
        m, plan, res, summary = self.metrics, job.plan, run.result, run.summary
        if run.ttft is None:                       # no token at all (immediate EOS): TTFT is the whole call
            run.ttft = time.perf_counter() - job.started
            ctx.leave_queue()
        fallbacks = (list(res.stats.fallbacks) if res else []) + list(summary.fallbacks)
        # what executed: a fallback that recomputed the prefix (a missing chunk, a refused or lost
        # block) makes the request a recompute, whatever was planned
        executed = "recompute" if any(f not in STORE_ONLY_FALLBACKS for f in fallbacks) else job.kind
        m.ttft.labels(executed).observe(run.ttft)
        m.count_request(executed, "ok", fallbacks[0] if fallbacks else "", record=ctx.outcome)
        for f in fallbacks:
            m.record_fallback(f)
        sources = prompt_sources(plan, res, summary)    # usage.cached_tokens: the prompt tokens nobody computed
        for src, n in sources.items():
            m.prompt_tokens.labels(src).inc(n)
        transport = self._account_transfer(res)
        got = {**(res.stats.stages if res is not None else {}), **dict(summary.stages)}
        stages = tuple((k, got[k]) for k in STAGES if k in got)
        for k, sec in stages:
            m.stage_seconds.labels(k, transport or "none").observe(sec)
        self.guard.after_response(plan, ctx.tenant or self.default_tenant, run.prefill_index)   # fire and forget
        return Finished(plan, summary, run.ttft, plan.prompt_tokens, sum(sources[k] for k in CACHED_SOURCES),
                        tuple(fallbacks), bool(res is not None and res.stored), stages, transport,
                        tuple(sources.items()), ctx.clock,
                        tuple(res.stats.prompt_logprobs) if res is not None else ())

    def _account_transfer(self, res: PrefillResult | None) -> str:
        """Count the prefill worker's tier and transfer work; the transport that carried the block ("": none)."""
        if res is None:
            return ""
        m = self.metrics
        m.tier_rewarms.inc(res.stats.rewarmed)
        m.chunk_variants.inc(res.stats.variants_compiled)
        if not res.transferred:
            return ""
        m.transfer_bytes.labels(res.transport or "grpc").inc(res.transfer_bytes)
        m.transfer_seconds.labels(res.transport or "grpc").observe(res.transfer_seconds)
        return res.transport

    @staticmethod
    async def _before(deadline: float, stage: str, aw):
        """Await ``aw`` until the deadline (perf_counter time); past it, DeadlineExceeded."""
        left = deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(aw, timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(stage) from None
