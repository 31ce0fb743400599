"""Decode migration: the decode half of one request, continued on another live decode worker when
its own is lost after the first token, so the client sees one uninterrupted stream.

:class:`DecodeStream` reads a decode worker's events for :class:`~cluster.control.lifecycle.RequestRunner`
and remembers what went out (token ids, text). When that worker is lost mid-stream
(:class:`~cluster.control.routing.WorkerLost`, role ``decode``) it picks another live decode worker and
calls it with a :class:`~kvruntime.messages.decode.Continuation`: no KV block is sent, the new worker
computes the prompt itself and replays the streamed tokens one decode step each (a counted recompute: the fallback
``decode_migrated``), then samples on from step ``len(tokens)`` with the same sampling parameters
(seed, penalties, stop strings, ``max_tokens`` and log-probs continue). Each migration is logged
and counted in ``kvnotes_retries_total{role="decode",reason="migrated"}``; at most
``FaultPolicy.decode_migrations`` per request (config ``decode_migrations``), after which, or when no
other decode worker is alive, the loss is raised as before (an in-band error, ``lost_mid_stream``).
A loss before the first token is raised unchanged: the runner retries the whole request
(``request_retries``). Past the deadline the current worker is told to stop; a consumer that goes
away (client gone) tells it too, without waiting. Both counted in ``kvnotes_cancels_total``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from cluster.control.cancel import cancel_soon
from cluster.control.metrics import Metrics
from cluster.control.routing import DeadlineExceeded, FaultPolicy, NoLiveWorker, WorkerLost, WorkerView
from kvruntime.messages.decode import Continuation, DecodeJob, DecodeSummary, TokenEvent

if TYPE_CHECKING:
    from cluster.control.backends import Backends

log = logging.getLogger(__name__)
MIGRATED = "decode_migrated"      # the fallback a migrated request records: its prompt was recomputed


class DecodeStream:
    """One request's decode events, migrated to another worker on a mid-stream loss (module doc).

    ``job``: the first worker's call; ``prompt_tokens``: the plan's (a migrated summary's
    prompt-cache counts are bounded by it); ``before(aw)`` awaits ``aw`` within the request's
    deadline (raises DeadlineExceeded); ``tried``: decode worker indices this request already
    lost (updated here)."""

    def __init__(self, backends: "Backends", view: WorkerView, fault: FaultPolicy, metrics: Metrics,
                 job: DecodeJob, prompt_tokens: int, tried: set[int], before: Callable[[Awaitable], Awaitable]):
        self.backends, self.view, self.fault, self.metrics = backends, view, fault, metrics
        self.job, self.prompt_tokens, self.tried, self.before = job, prompt_tokens, tried, before
        self.request_id, self.sampling = job.request_id, job.sampling
        self.tokens: list[int] = []        # token ids streamed so far (from every worker)
        self.text: list[str] = []          # their events' text
        self.migrations = 0
        self.index: int | None = None      # the decode worker now streaming
        self.key: str | None = None        # its cancel key
        self._can_cancel = backends.cancels
        self._loads: list[tuple[int, int]] = []   # (worker, tokens) this stream added to the view

    async def events(self, index: int) -> AsyncIterator[TokenEvent | DecodeSummary]:
        """Tokens from worker ``index`` (the job's block pushed to it, if any), then from the workers
        it migrates to; last a DecodeSummary covering the whole request."""
        job = self.job
        cont: Continuation | None = None
        while True:
            self.index, self.key = index, job.cancel_key
            gen = self.backends.decode(index, job)
            try:
                async for ev in self._read(gen):
                    if isinstance(ev, TokenEvent):
                        self.tokens.append(ev.token_id)
                        self.text.append(ev.text)
                    elif cont is not None:
                        ev = self._migrated_summary(ev)
                    yield ev
                return
            except WorkerLost as exc:
                if exc.role != "decode" or not self.tokens:
                    raise                       # before the first token: the runner retries the request
                self.tried.add(exc.index)
                index = self._next_worker(exc)
                self.migrations += 1
                self.metrics.retries.labels("decode", "migrated").inc()
                log.warning("request %s: %s after %d tokens; continuing on decode-%d with the prompt plus those "
                            "tokens (migration %d/%d)", self.request_id, exc, len(self.tokens), index,
                            self.migrations, self.fault.decode_migrations)
                cont = Continuation(tuple(self.tokens), "".join(self.text))
                # no block comes: the new worker computes the prompt plus the streamed tokens itself
                job = dataclasses.replace(self.job, transfer_id=None, computes_rest=False, continuation=cont,
                                          cancel_key=f"{self.job.cancel_key}~m{self.migrations}")
                left = self._left()
                self.view.begin("decode", index, left)     # released by close()
                self._loads.append((index, left))

    def _left(self) -> int:
        return max(self.sampling.max_tokens - len(self.tokens), 0)

    def _next_worker(self, exc: WorkerLost) -> int:
        """Another live decode worker, or the loss re-raised (no budget, none alive)."""
        if self.migrations >= self.fault.decode_migrations:
            log.error("request %s: %s after %d tokens; %d migration(s) allowed (decode_migrations), all used",
                      self.request_id, exc, len(self.tokens), self.fault.decode_migrations)
            raise exc
        try:
            return self.view.pick_decode(exclude=self.tried)
        except NoLiveWorker as none:
            log.error("request %s: %s after %d tokens and no decode worker to continue on (%s)",
                      self.request_id, exc, len(self.tokens), none)
            raise exc from None

    def _migrated_summary(self, s: DecodeSummary) -> DecodeSummary:
        """The last worker's summary, marked as a recompute (its prompt KV was computed there, not
        received) and with prompt-cache counts bounded by the request's prompt."""
        return dataclasses.replace(s, fallbacks=(*s.fallbacks, MIGRATED),
                                   cached_tokens=min(s.cached_tokens, self.prompt_tokens),
                                   loaded_tokens=0)

    async def _read(self, gen) -> AsyncIterator[TokenEvent | DecodeSummary]:
        while True:
            try:
                ev = await self.before(gen.__anext__())
            except StopAsyncIteration:
                return
            except DeadlineExceeded:
                if self._can_cancel:
                    self.metrics.cancels.labels("decode", "deadline").inc()
                    await self.backends.cancel(self.index, self.key)
                raise
            yield ev

    def abandon(self) -> None:
        """The consumer went away (client gone): tell the current worker to stop, without waiting."""
        if self._can_cancel and self.index is not None:
            self.metrics.cancels.labels("decode", "client_gone").inc()
            log.info("request %s: client gone; decode-%d told to stop", self.request_id, self.index)
            cancel_soon(self.backends.cancel(self.index, self.key))

    def close(self) -> None:
        """Release the view load this stream took on the workers it migrated to."""
        for index, tokens in self._loads:
            self.view.end("decode", index, tokens)
        self._loads = []
