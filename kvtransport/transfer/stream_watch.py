"""Streams that have not sent their header yet, bounded in time and number, so that idle
connections cannot hold the gRPC inbox's threads (issue 45, item 5).

gRPC's synchronous server gives every incoming stream a worker thread at once, and that thread
waits in ``next(request_iterator)`` for the first message with no deadline of its own. A
:class:`HeaderWatch` holds each such stream from its start until its header arrives:

- a stream still without a header after ``timeout_s`` is cancelled (``no_header``);
- at most ``per_peer`` streams of one peer host wait at once: a newer one cancels that host's
  oldest waiting stream (``stream_limit``), so a host that opens idle streams only churns its own,
  while a sender whose header follows at once (every real push) passes;
- at most ``total`` wait across all hosts (the oldest is cancelled past it), and the server has
  ``workers + total`` threads, so pushes with headers always find one.
Cancelled streams are counted by reason (:attr:`cancelled`) and logged at 1, 10, 100 and every
1000th, never flooded. One thread per watch, sleeping until the next deadline.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

log = logging.getLogger(__name__)


class HeaderWatch:
    def __init__(self, timeout_s: float, per_peer: int, total: int):
        if timeout_s <= 0 or per_peer < 1 or total < per_peer:
            raise ValueError("first_message_timeout_s must be > 0 and 1 <= max_waiting_streams_per_peer "
                             "<= max_waiting_streams")
        self.timeout_s, self.per_peer, self.total = timeout_s, per_peer, total
        self._waiting: collections.OrderedDict[int, tuple[str, object, float]] = collections.OrderedDict()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self.cancelled: collections.Counter[str] = collections.Counter()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kv-inbox-header-watch", daemon=True)
        self._thread.start()

    def enter(self, host: str, context) -> int:
        """Watch a stream of ``host`` whose header has not arrived; returns its token."""
        with self._cv:
            token = next(self._ids)
            self._waiting[token] = (host, context, time.monotonic() + self.timeout_s)
            mine = [t for t, (h, _, _) in self._waiting.items() if h == host]
            for t in mine[:max(0, len(mine) - self.per_peer)]:
                self._cancel(t, "stream_limit")
            while len(self._waiting) > self.total:
                self._cancel(next(iter(self._waiting)), "stream_limit")
            self._cv.notify()
            return token

    def leave(self, token: int) -> None:
        """The stream's header arrived (or the stream ended): no longer watched."""
        with self._cv:
            self._waiting.pop(token, None)

    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _cancel(self, token: int, reason: str) -> None:
        host, context, _ = self._waiting.pop(token)
        self.cancelled[reason] += 1
        n = self.cancelled[reason]
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("KV inbox: cancelled a stream from %s that sent no header (%s; %d so far)", host, reason, n)
        try:
            context.cancel()
        except Exception as exc:       # the stream ended meanwhile: nothing to cancel
            log.debug("cancel of a finished stream: %s", exc)

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                now = time.monotonic()
                for t in [t for t, (_, _, due) in self._waiting.items() if due <= now]:
                    self._cancel(t, "no_header")
                due = min((d for _, _, d in self._waiting.values()), default=None)
                self._cv.wait(None if due is None else max(0.01, due - now))
