"""Plan-time tier lookups: which of some KV refs a prefill worker's tiers hold, counted in
``kvnotes_tier_lookups_total`` / ``kvnotes_tier_hits_total`` (misses included) and timed on the
request's stage clock. A lost worker is planned as a miss (counted fallback); the runner then
retries the prefill elsewhere."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cluster.control.metrics import Metrics
from cluster.control.routing import WorkerLost
from kvruntime.messages.plan import KVRef

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.lifecycle import StageClock

log = logging.getLogger(__name__)


class TierLookup:
    def __init__(self, backends: "Backends", metrics: Metrics):
        self.backends, self.metrics = backends, metrics

    async def present(self, refs: list[KVRef], index: int = 0, clock: "StageClock | None" = None) -> set[str]:
        """Digests of ``refs`` prefill worker ``index``'s tiers hold."""
        if not refs:
            return set()
        started = time.perf_counter()
        try:
            got = await self.backends.contains(refs, index)
            if clock is not None:
                clock.add("tier_lookup", time.perf_counter() - started)
        except WorkerLost as exc:    # plan as if nothing is cached; the runner retries the prefill elsewhere
            self.metrics.record_fallback("tier_lookup_worker_lost")
            log.warning("tier lookup failed (%s): planning without cached KV", exc)
            return set()
        self.metrics.tier_lookups.labels("lmcache").inc(len(refs))
        self.metrics.tier_hits.labels("lmcache").inc(sum(got))
        return {r.digest for r, ok in zip(refs, got) if ok}
