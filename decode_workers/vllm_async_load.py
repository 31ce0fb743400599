"""The kvnotes connector's asynchronous load (vLLM's ``load_kv_async`` protocol), worker side.

The scheduler side returns ``(n, True)`` from ``get_num_new_matched_tokens``: vLLM allocates the
request's blocks and parks it in ``WAITING_FOR_REMOTE_KVS`` while the engine keeps stepping the
running requests. :class:`AsyncLoader` runs each load (claim the block from the inbox, verify,
decode, write every layer into the paged cache) on a small bounded thread pool and marks the
request done only after its last layer is written; ``get_finished`` hands the done ids to vLLM,
which then caches those blocks and schedules the request.

Why writing from another thread is safe: the slots written belong to blocks vLLM allocated to
the waiting request alone (a load never writes a block another request shares: the part vLLM's
prefix cache held is skipped, and vLLM does not cache the new blocks before ``finished_recving``);
no forward reads them before the request is reported done; and a request aborted while its load
runs keeps its blocks until it is reported done (vLLM delays their free), so a block is never
reused under a running write. The forward of the running requests writes and reads other slots
of the same cache tensors, never these.

A load that fails (missing, late, corrupt, mismatched block; any error) still completes: its
blocks are reported through ``get_block_ids_with_load_errors`` no later than the step its id is
returned as finished, and vLLM's ``kv_load_failure_policy`` recomputes or fails the request.

A load's end is announced to the listeners of :func:`on_load_done` (the decode engine's step loop,
which then steps at once instead of polling: empty steps every 2 ms ran beside the write on the
2-core machine and slowed it, issue 47).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger(__name__)

_listeners: list[Callable[[], None]] = []
_listeners_lock = threading.Lock()


def on_load_done(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn()`` whenever an awaited async load of this process ends (no loader lock held);
    returns the function that unregisters it."""
    with _listeners_lock:
        _listeners.append(fn)

    def remove() -> None:
        with _listeners_lock:
            if fn in _listeners:
                _listeners.remove(fn)
    return remove


def _announce() -> None:
    with _listeners_lock:
        fns = list(_listeners)
    for fn in fns:
        try:
            fn()
        except Exception:  # a listener's failure never fails the load; logged
            log.exception("kvnotes: a load-done listener failed")


class AsyncLoader:
    """``run(job)`` per load on ``threads`` workers. ``job()`` returns None on success or a failure
    reason; ``on_failure(req_id, reason)`` records it (under the connector's lock) before the id is
    marked done, so a failure is always visible when its completion is."""

    def __init__(self, threads: int, lock: threading.Lock, on_failure: Callable[[str, str], None]):
        if threads < 1:
            raise ValueError("kvnotes_load_threads must be >= 1")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvnotes-load")
        self._lock = lock                          # the connector's: failures and completions move together
        self._on_failure = on_failure
        self._done: set[str] = set()               # loads finished (ok or failed), not yet reported
        self._inflight: set[str] = set()
        self._closed = False

    def submit(self, req_id: str, job: Callable[[], str | None], *, report: bool = True) -> None:
        """Start ``job`` for ``req_id``. ``report`` False: nobody waits for it (a block whose
        tokens vLLM's prefix cache already holds is only claimed and dropped)."""
        if report:
            with self._lock:
                self._inflight.add(req_id)
        self._pool.submit(self._run, req_id, job, report)

    def _run(self, req_id: str, job: Callable[[], str | None], report: bool) -> None:
        reason = None
        try:
            if not self._closed:
                reason = job()
        except Exception as exc:                   # never leave vLLM waiting: any error is a failed load
            log.exception("kvnotes: async KV load for request %s failed", req_id)
            reason = f"kv_load_error:{type(exc).__name__}"
        finally:
            if report:
                with self._lock:
                    if reason is not None:
                        self._on_failure(req_id, reason)
                    self._inflight.discard(req_id)
                    self._done.add(req_id)
                _announce()                        # after the lock: a listener may take its own

    def take_done(self) -> set[str]:
        """Request ids whose load ended since the last call (caller holds no lock)."""
        with self._lock:
            out, self._done = self._done, set()
        return out

    def pending(self) -> int:
        with self._lock:
            return len(self._inflight)

    def shutdown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
