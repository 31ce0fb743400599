"""What the control plane needs from the workers, as a contract: the router and
:mod:`cluster.control.lifecycle` talk to prefill and decode workers only through :class:`Backends`.
Production implements it with Ray actor handles (:class:`cluster.control.ray_backends.RayBackends`);
unit tests implement it in process. Every value crossing it is a message from ``kvruntime.messages``.

Every method is declared here: the abstract ones each implementation must give; the others have
a default that is right for backends in one process (no health thread, nothing to cancel: an
in-process call finishes on its own). Callers never probe for a method. Worker deaths are raised
as :class:`~cluster.control.routing.WorkerLost`.

Background work (a store-behind compile, a recurring span's or unit's compile) reaches the
workers through one :class:`YieldingBackends` per router replica, which lets this replica's
requests go first (:class:`YieldConfig`); work a caller waits for (a request's build, a
registration's core) does not go through it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from cluster.control.routing import FaultPolicy, WorkerView
from kvruntime.messages.decode import DecodeJob, DecodeSummary, TokenEvent
from kvruntime.messages.fidelity import ShadowResult
from kvruntime.messages.plan import KVRef, RequestPlan
from kvruntime.messages.prefill import PrecompileInfo, PrefillJob, PrefillResult
from kvruntime.messages.transfer import ExpectReply, TransferExpectation

if TYPE_CHECKING:
    from cluster.control.metrics import Metrics

log = logging.getLogger(__name__)


class Backends(ABC):
    num_prefill: int
    num_decode: int
    #: whether :meth:`cancel` and :meth:`cancel_prefill` reach a worker (the router counts a
    #: cancel in ``kvnotes_cancels_total`` only then)
    cancels: bool = False

    # ---- the tier -------------------------------------------------------------------------
    @abstractmethod
    async def contains(self, refs: list[KVRef], index: int = 0) -> list[bool]: ...

    @abstractmethod
    async def precompile(self, ref: KVRef, index: int = 0) -> PrecompileInfo:
        """Compile ``ref`` into a prefill worker's tier. Store-behind also passes ``base=`` (an
        exact stored prefix of the prompt ``ref``: only the rest is computed, after its KV)."""

    @abstractmethod
    async def evict(self, ref: KVRef) -> bool: ...

    # ---- one request (each call one message: kvruntime.messages) ----------------------------
    @abstractmethod
    async def expect(self, decode_index: int, expectation: TransferExpectation) -> ExpectReply:
        """Announce a transfer to decode worker ``decode_index``; it answers the leading prefix
        tokens it holds and whether it computes the rest of the prefix itself (then no block is
        expected and ``decode`` computes it)."""

    @abstractmethod
    async def prefill(self, index: int, decode_index: int, job: PrefillJob) -> PrefillResult:
        """Run ``job`` on prefill worker ``index``, pushing to decode worker ``decode_index``."""

    @abstractmethod
    def decode(self, index: int, job: DecodeJob) -> AsyncIterator[TokenEvent | DecodeSummary]:
        """Stream the tokens of decode worker ``index`` (``job.cancel_key``: what :meth:`cancel`
        names to stop it; ``job.continuation``: resume a stream another worker started and lost,
        :mod:`cluster.control.migration`)."""

    async def shadow(self, index: int, plan: RequestPlan) -> ShadowResult:
        """Recompute ``plan`` in full on prefill worker ``index`` and compare (online shadow check).
        Default: these backends run none (the guard logs and counts the failure)."""
        raise NotImplementedError(f"{type(self).__name__} runs no shadow checks")

    # ---- stopping work nobody waits for (cluster.control.cancel) ---------------------------
    async def cancel(self, index: int, cancel_key: str) -> None:
        """Stop decode worker ``index``'s stream started with ``cancel_key``. Default: nothing to
        stop (``cancels`` is False)."""

    async def cancel_prefill(self, index: int, transfer_id: str) -> None:
        """Stop prefill worker ``index``'s plan for ``transfer_id``. Default: nothing to stop."""

    # ---- health and routing ---------------------------------------------------------------
    #: retries, deadline and decode migrations (production: from config)
    fault_policy: FaultPolicy = FaultPolicy()

    @property
    def view(self) -> WorkerView:
        """The live view the router picks workers from (default: every worker alive, made once)."""
        v = self.__dict__.get("_view")
        if v is None:
            v = self.__dict__["_view"] = WorkerView(self.num_prefill, self.num_decode)
        return v

    @view.setter
    def view(self, v: WorkerView) -> None:
        self.__dict__["_view"] = v

    def start_health(self, metrics) -> None:
        """Start watching the workers (``cluster.control.health``). Default: nothing to watch."""

    #: completed health sweeps (``/ready`` waits for the first); default: always ready
    health_sweeps: int = 1
    #: this replica's admission queue, sent with each prefill health probe (None: nothing sent);
    #: set by ``cluster.control.assembly`` once its admission exists
    queue_report = None

    def exchange_queues(self, report, timeout_s: float):
        """Send this replica's :class:`QueueReport` to the ledger prefill worker; an awaitable of
        every replica's queue it holds, or None (cannot be asked: ``cluster.control.exchange``).
        Default: None."""
        return None

    @property
    def peers(self):
        """The other replicas' admission queues, as the prefill workers' health answers report them."""
        p = self.__dict__.get("_peers")
        if p is None:
            from cluster.control.peers import PeerQueues
            p = self.__dict__["_peers"] = PeerQueues()
        return p


# ---- background work yields to requests -----------------------------------------------------
@dataclass(frozen=True)
class YieldConfig:
    """Background compiles yield to requests: each waits, before it starts, until no request of
    this router replica has been in flight for ``quiet_s`` seconds (a prefill worker's forward
    cannot be paused once started, and on a few CPU cores it slows the decode engine's prompt
    beside it), at most ``max_wait_s`` (then it runs anyway, counted). ``quiet_s`` 0: off."""
    quiet_s: float = 0.5            # seconds without a request in flight before a compile starts
    max_wait_s: float = 30.0        # the longest a compile waits for requests (then it runs)

    def __post_init__(self):
        if self.quiet_s < 0 or self.max_wait_s < 0:
            raise ValueError(f"background yield: quiet_s and max_wait_s must be >= 0, got {self.quiet_s}, "
                             f"{self.max_wait_s}")


class RequestActivity:
    """This replica's requests in flight (one event loop: plain counters), how many have started,
    and when the last one ended (``time.monotonic``)."""

    def __init__(self):
        self.active = 0                 # requests between their stream's start and end
        self.started = 0                # requests ever started
        self.last_end = float("-inf")

    @contextlib.contextmanager
    def request(self):
        self.active += 1
        self.started += 1
        try:
            yield
        finally:
            self.active -= 1
            self.last_end = time.monotonic()

    def quiet_for(self, now: float) -> float:
        """Seconds since the last request ended with none in flight (0 while one is)."""
        return 0.0 if self.active else now - self.last_end


class YieldingBackends:
    """``backends`` as background work sees them: :meth:`precompile` first yields to requests
    (:class:`YieldConfig`); every other attribute is the wrapped backends' own. Counted in
    ``kvnotes_fallbacks_total``: ``background_deferred`` (a request that started after the
    compile was asked for went first), ``background_deferral_expired`` (it stopped waiting at
    ``max_wait_s`` with requests still coming and ran beside them)."""
    POLL_S = 0.02

    def __init__(self, backends: Backends, activity: RequestActivity, cfg: YieldConfig, metrics: "Metrics"):
        self._backends, self.activity, self.cfg, self.metrics = backends, activity, cfg, metrics
        for reason in ("background_deferred", "background_deferral_expired"):
            metrics.fallbacks.labels(reason)        # zeros: a first deferral is an increase rate() sees

    def __getattr__(self, name):
        return getattr(self._backends, name)

    async def precompile(self, ref: KVRef, index: int = 0, **kw) -> PrecompileInfo:
        await self.yield_to_requests()
        return await self._backends.precompile(ref, index, **kw)

    async def yield_to_requests(self) -> str:
        """Wait for a quiet moment: ``off``, ``ran`` (quiet already, or only the request that asked
        for it was running), ``deferred`` or ``expired`` (see the class)."""
        cfg, act = self.cfg, self.activity
        if cfg.quiet_s <= 0:
            return "off"
        start, seen = time.monotonic(), act.started
        while (quiet := act.quiet_for(now := time.monotonic())) < cfg.quiet_s:
            if now - start >= cfg.max_wait_s:
                self.metrics.record_fallback("background_deferral_expired")
                log.info("a background compile waited %.1f s for requests to pause: run beside them", now - start)
                return "expired"
            await asyncio.sleep(min(self.POLL_S, cfg.quiet_s - quiet))
        if act.started > seen:
            self.metrics.record_fallback("background_deferred")
            return "deferred"
        return "ran"
