"""Whether this router replica reaches its state store. A daemon thread pings the store every
``state_probe_s`` (one cheap round trip, failing within ``state_timeout_s``); every store call a
request makes that gets no answer marks it down at once (``StateStore.on_unavailable``). Only a
probe that gets an answer marks it up again. While it is down ``/ready`` answers 503 and
``/health`` says ``degraded``; exported as ``kvnotes_state_store_up`` and
``kvnotes_state_store_errors_total{op}`` (``op="ping"``: the probe).
"""
from __future__ import annotations

import logging
import threading
import time

from cluster.control.state.base import StateStore, StateStoreUnavailable

log = logging.getLogger(__name__)


class StoreWatch:
    def __init__(self, state: StateStore, metrics, period_s: float, *, start: bool = True):
        self.state, self.metrics, self.period_s = state, metrics, period_s
        self._lock = threading.Lock()
        self.up, self.error, self._down_since = True, "", 0.0   # the store answered when the replica opened it
        self.stopped = threading.Event()
        state.on_unavailable = self._failed
        metrics.state_store_up.set(1)
        metrics.state_store_errors.labels("ping")       # zero: the first failed probe is an increase
        if start:
            threading.Thread(target=self._run, name="kvnotes-state-watch", daemon=True).start()

    def _failed(self, op: str, exc: StateStoreUnavailable) -> None:
        self.metrics.state_store_errors.labels(op).inc()
        with self._lock:
            was_up, self.up, self.error = self.up, False, str(exc)
            if was_up:
                self._down_since = time.monotonic()
        self.metrics.state_store_up.set(0)
        if was_up:
            log.warning("state store down (seen by %s): %s", "the probe" if op == "ping" else f"a request's {op}", exc)

    def probe(self) -> bool:
        """Ping once; True (and marked up) when the store answered."""
        try:
            self.state.ping()
        except StateStoreUnavailable:
            return False                     # counted and marked down by _failed
        with self._lock:
            was_up, self.up, self.error = self.up, True, ""
        self.metrics.state_store_up.set(1)
        if not was_up:
            log.warning("state store answers again after %.1f s", time.monotonic() - self._down_since)
        return True

    def snapshot(self) -> dict:
        with self._lock:
            return {"up": self.up, "error": self.error,
                    "down_for_s": 0.0 if self.up else round(time.monotonic() - self._down_since, 3)}

    def _run(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                self.probe()
            except Exception:               # never let the watch die: log and probe again next period
                log.exception("state store probe failed")
