"""One request's execution after planning: prefill on a prefill worker, the KV pushed to a
decode worker, tokens streamed back; retried once elsewhere when a worker is lost before the
first token, continued on another decode worker when its own is lost mid-stream
(:mod:`cluster.control.migration`), cut at the deadline, and accounted (TTFT and requests by what *executed*, prompt
tokens by source, transfer bytes, stage seconds, fallbacks) in :class:`~cluster.control.metrics.Metrics`.

The router plans (:mod:`cluster.control.planner`); :class:`RequestRunner` executes the plan it is given
and never re-plans: a lost or refused block becomes the decode worker's counted recompute, not a
new plan. It talks to workers only through the ``Backends`` protocol (:mod:`cluster.control.backends`).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from cluster.control import admission
from cluster.control.cancel import prefill_or_cancel
from cluster.control.errors import RequestError
from cluster.control.metrics import CACHED_SOURCES, Metrics, note_first_token, note_plan, prompt_sources
from cluster.control.migration import DecodeStream
from cluster.control.routing import DeadlineExceeded, FaultPolicy, NoLiveWorker, WorkerLost, WorkerView
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.messages.plan import KVRef, RequestPlan, decode_computes_rest
from kvruntime.messages.prefill import PrefillResult
from kvruntime.messages.transfer import STAGES, TransferGrant

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.shadow import FidelityGuard

log = logging.getLogger(__name__)
# Fallbacks after which the request still executed as planned: only storing its KV failed, the KV
# was built in ordinary memory because the NIXL send pool was full (the send copied it), or the
# block travelled over gRPC instead of NIXL (and arrived: a lost block adds its own reason)
STORE_ONLY_FALLBACKS = frozenset({"tier_store_failed", "kv_send_pool_full", "kv_transport_nixl_unavailable",
                                  "kv_transport_nixl_to_grpc"})


@dataclass
class StageClock:
    """One request's control-path clock: consecutive laps (``lap(name)``: seconds since the previous
    lap, so the laps add up to the time since ``start``) plus named amounts measured elsewhere
    (``add``). ``start`` and ``first_token`` are ``time.perf_counter()`` values (CLOCK_MONOTONIC on
    Linux: comparable with a client's on the same machine). Shown as ``explain.control``."""
    start: float = field(default_factory=time.perf_counter)
    laps: list = field(default_factory=list)          # (stage, seconds), in order
    extra: dict = field(default_factory=dict)          # stage -> seconds measured by a worker
    first_token: float | None = None
    _last: float | None = None

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - (self._last if self._last is not None else self.start)))
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        self.extra[name] = self.extra.get(name, 0.0) + seconds

    def as_json(self) -> dict:
        return {"start": self.start, "first_token": self.first_token,
                "laps": [[k, round(v, 6)] for k, v in self.laps], "worker": {k: round(v, 6) for k, v in self.extra.items()}}


#: the clock of the request being served (set by the HTTP layer; None outside a request: no laps)
CLOCK: contextvars.ContextVar[StageClock | None] = contextvars.ContextVar("kvnotes_stage_clock", default=None)


def lap(clock: StageClock | None, name: str) -> None:
    if clock is not None:
        clock.lap(name)


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


class RequestRunner:
    def __init__(self, backends: "Backends", view: WorkerView, fault: FaultPolicy, metrics: Metrics, dtype: str,
                 guard: "FidelityGuard", default_tenant: str):
        self.backends, self.view, self.fault, self.metrics = backends, view, fault, metrics
        self.dtype, self.guard, self.default_tenant = dtype, guard, default_tenant

    async def run(self, plan: RequestPlan, sampling: SamplingParams, t0: float,
                  store_as: KVRef | None, pi: int, salt: str,
                  deadline_s: float | None = None, leases: list = (),
                  tenant: str | None = None, clock: StageClock | None = None) -> AsyncIterator[TokenEvent | Finished]:
        """Prefill then decode, on the least loaded live decode worker. A worker lost before the
        first token: retried on another one (``request_retries``); a decode worker lost mid-stream:
        the stream continues on another one (``decode_migrations``, cluster.control.migration), and
        past that a clear error. Past the deadline or with the client gone: the worker at work is
        told to stop (prefill or decode); past the deadline, 504. All counted."""
        m = self.metrics
        kind = plan.kind.value
        note_plan(kind)                            # the API layer's label for it if it is abandoned
        deadline = t0 + min(deadline_s or self.fault.deadline_s, self.fault.deadline_s)
        tried = {"prefill": set(), "decode": set()}
        attempt, ttft, sent = 0, None, 0
        # each is a pass over every prefix token (kv_salt hashes the plan's recipe and tokens): once
        prefix_ids, kv_salt = plan.prefix_ids, plan.kv_salt(salt)
        while True:
            try:
                di = self.view.pick_decode(exclude=tried["decode"])
                if pi in tried["prefill"] or not self.view.is_alive("prefill", pi):
                    pi = self.view.pick_prefill(None, exclude=tried["prefill"])
            except NoLiveWorker as exc:
                m.count_request(kind, "no_live_worker")
                raise RequestError(503, str(exc), code="no_live_worker") from None
            tid = f"{plan.request_id}-{uuid.uuid4().hex[:8]}"
            self.view.begin("decode", di, sampling.max_tokens)
            try:
                res, own = None, False
                if plan.steps:
                    self.view.begin("prefill", pi, plan.prompt_tokens)
                    for lease in leases:
                        lease.release()            # the pick's reservation becomes this call's load
                    try:
                        # the decode actor accepts this block only: credential (the prefill actor's
                        # alone), shape, dtype
                        grant, cred = TransferGrant.issue(tid, plan.model, self.dtype, prefix_ids)
                        # ship nothing twice: the decode actor says how much of the prefix it holds;
                        # build nothing twice: holding up to the plan's forward_from, it computes the
                        # rest itself and no prefill runs (not for a session's context to store)
                        computes_from = None if store_as is not None and plan.session else plan.forward_from
                        lap(clock, "grant")
                        held = await self._before(deadline, "prefill", self.backends.expect(
                            di, grant, prefix_ids, kv_salt, computes_from))
                        lap(clock, "expect_call")
                        own = decode_computes_rest(held, computes_from)
                        if not own:
                            # past the deadline or with the client gone, the prefill worker is told to stop
                            res = await prefill_or_cancel(self.backends, m, pi, tid, plan.request_id, self._before(
                                deadline, "prefill", self.backends.prefill(pi, plan, di, tid, store_as, credential=cred,
                                                                           send_from=held)))
                            lap(clock, "prefill_call")
                            if clock is not None:     # what the prefill actor itself measured of that call
                                clock.add("prefill_build", res.seconds)
                                clock.add("prefill_send", sum(v for k, v in res.stats.stages.items()
                                                              if k in ("serialise", "transfer")))
                    finally:
                        self.view.end("prefill", pi, plan.prompt_tokens)
                fallbacks = list(res.stats.fallbacks) if res else []
                # -- decode: continued on another decode worker when this one is lost mid-stream, told to
                # stop past the deadline or when the client leaves (cluster.control.migration)
                stream = DecodeStream(self.backends, self.view, self.fault, m, plan, sampling, kv_salt,
                                      tried["decode"], lambda aw: self._before(deadline, "decode", aw))
                try:
                    async for ev in stream.events(di, tid if own or (res is not None and res.transferred) else None,
                                                  tid):
                        if isinstance(ev, TokenEvent):
                            if ttft is None:           # observed below, labelled with what executed
                                ttft = time.perf_counter() - t0
                                admission.first_token()     # out of the admission queue (a service sample)
                                note_first_token()
                                if clock is not None:
                                    lap(clock, "decode_call")
                                    clock.first_token = time.perf_counter()
                            sent += 1
                            yield ev
                        else:
                            summary = ev
                except (GeneratorExit, asyncio.CancelledError):
                    stream.abandon()
                    raise
                finally:
                    stream.close()
                # -- end of decode
                fallbacks += list(summary.fallbacks)
                break
            except WorkerLost as exc:
                tried[exc.role].add(exc.index)
                if sent == 0 and attempt < self.fault.retries:
                    attempt += 1
                    m.retries.labels(exc.role, "lost_before_first_token").inc()
                    log.warning("request %s: %s before its first token; retrying on another worker (%d/%d)",
                                plan.request_id, exc, attempt, self.fault.retries)
                    continue
                reason = "lost_mid_stream" if sent else "retries_exhausted"
                m.retries.labels(exc.role, reason).inc()
                m.count_request(kind, "worker_lost")
                log.error("request %s failed: %s (%s after %d tokens)", plan.request_id, exc, reason, sent)
                if sent:
                    raise WorkerLost(exc.role, exc.index, f"{exc.reason} mid-stream after {sent} tokens; the answer "
                                     "is incomplete, send the request again") from None
                raise RequestError(503, f"{exc}; retried {attempt} time(s) without success, send the request "
                                        "again", code="worker_lost") from None
            except DeadlineExceeded as exc:
                m.deadlines.labels(exc.stage).inc()
                m.count_request(kind, "deadline")
                log.warning("request %s: deadline passed during %s; worker told to stop", plan.request_id, exc.stage)
                raise RequestError(504, str(exc), code="deadline_exceeded") from None
            except RequestError:
                m.count_request(kind, "client_error")
                raise
            except Exception:
                m.count_request(kind, "error")
                raise
            finally:
                self.view.end("decode", di, sampling.max_tokens)

        yield self._account(plan, t0, ttft, res, summary, fallbacks, pi, tenant, clock)

    def _account(self, plan: RequestPlan, t0: float, ttft: float | None,
                 res: PrefillResult | None, summary: DecodeSummary, fallbacks: list[str], pi: int,
                 tenant: str | None, clock: StageClock | None = None) -> Finished:
        """Record what executed (not what was planned) and build the request's last event."""
        m = self.metrics
        kind = plan.kind.value
        if ttft is None:                           # no token at all (immediate EOS): TTFT is the whole call
            ttft = time.perf_counter() - t0
            admission.first_token()
        # what executed: a fallback that recomputed the prefix (a missing chunk, a refused or lost
        # block) makes the request a recompute, whatever was planned
        executed = "recompute" if any(f not in STORE_ONLY_FALLBACKS for f in fallbacks) else kind
        m.ttft.labels(executed).observe(ttft)
        m.count_request(executed, "ok", fallbacks[0] if fallbacks else "")
        for f in fallbacks:
            m.record_fallback(f)
        # usage.cached_tokens: exactly the prompt tokens nobody computed for this request
        sources = prompt_sources(plan, res, summary)
        for src, n in sources.items():
            m.prompt_tokens.labels(src).inc(n)
        cached = sum(sources[k] for k in CACHED_SOURCES)
        if res is not None:
            m.tier_rewarms.inc(res.stats.rewarmed)
            m.chunk_variants.inc(res.stats.variants_compiled)
            if res.transferred:
                m.transfer_bytes.labels(res.transport or "grpc").inc(res.transfer_bytes)
                m.transfer_seconds.labels(res.transport or "grpc").observe(res.transfer_seconds)
        transport = res.transport if res is not None and res.transferred else ""
        got = {**(res.stats.stages if res is not None else {}), **dict(summary.stages)}
        stages = tuple((k, got[k]) for k in STAGES if k in got)
        for k, sec in stages:
            m.stage_seconds.labels(k, transport or "none").observe(sec)
        self.guard.after_response(plan, tenant or self.default_tenant, pi)   # shadow check: fire and forget
        return Finished(plan, summary, ttft, plan.prompt_tokens, cached, tuple(fallbacks),
                        bool(res is not None and res.stored), stages, transport, tuple(sources.items()), clock)

    @staticmethod
    async def _before(deadline: float, stage: str, aw):
        """Await ``aw`` until the deadline (perf_counter time); past it, DeadlineExceeded."""
        left = deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(aw, timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(stage) from None
