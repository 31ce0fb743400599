"""Tier reads issued ahead of a plan's steps, so reading chunk i+1 overlaps re-rotating chunk i.

One background thread reads the plan's KV references in step order (``KVSource.get``); at most
``ahead`` reads are issued and not yet taken, so memory stays bounded (the chunk being used plus
``ahead`` more). :meth:`Prefetcher.take` hands the executor the next result in order, raising
what the read raised; a reference out of order is read directly. :meth:`close` cancels the reads
not started and waits for the one running (a tier read is bounded by the tier's timeout), so a
cancelled build leaves no read behind.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from kvruntime.kv import KVCache
from kvruntime.messages.plan import KVRef


class Prefetcher:
    def __init__(self, source, refs: list[KVRef], ahead: int = 1):
        if ahead < 1:
            raise ValueError("prefetch depth must be >= 1")
        self.source, self.ahead = source, ahead
        self._todo: deque[KVRef] = deque(refs)
        self._issued: deque[tuple[KVRef, Future]] = deque()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch") if refs else None
        self._fill()

    def _fill(self) -> None:
        while self._todo and len(self._issued) < self.ahead:
            ref = self._todo.popleft()
            self._issued.append((ref, self._pool.submit(self.source.get, ref)))

    def take(self, ref: KVRef) -> KVCache | None:
        """``source.get(ref)``: the read issued ahead when ``ref`` is next in order (waits for it)."""
        if not self._issued or self._issued[0][0] is not ref:
            return self.source.get(ref)
        _, fut = self._issued.popleft()
        try:
            return fut.result()
        finally:
            self._fill()

    def close(self) -> None:
        self._todo.clear()
        for _, fut in self._issued:
            fut.cancel()
        self._issued.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
