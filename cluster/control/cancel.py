"""Telling workers to stop work nobody waits for any more: a request past its deadline, a client
that went away. The router sends the cancel in the actor's "health" concurrency group
(``cluster.control.ray_backends``: ``cancel`` for decode, ``cancel_prefill`` for prefill), where
it runs beside the work; the worker stops at its next token (decode) or its next layer or plan
step (prefill). Every cancel is counted in ``kvnotes_cancels_total{role,reason}``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, TypeVar

from cluster.control.metrics import Metrics
from cluster.control.routing import DeadlineExceeded

if TYPE_CHECKING:
    from cluster.control.backends import Backends

log = logging.getLogger(__name__)
T = TypeVar("T")
_background: set[asyncio.Task] = set()   # fire-and-forget cancels, referenced until done


def cancel_soon(aw: Awaitable) -> None:
    """Run ``aw`` (a worker's cancel call) without waiting for it: the caller is past its deadline,
    or being closed or cancelled, and must not block on a worker. Failures are logged."""
    async def run():
        try:
            await aw
        except Exception as exc:            # the worker is gone: nothing left to stop
            log.warning("cancel call failed: %s", exc)
    try:
        task = asyncio.get_running_loop().create_task(run())
    except RuntimeError:                    # no running loop (interpreter shutdown): nothing to stop it with
        if hasattr(aw, "close"):
            aw.close()
        return
    _background.add(task)
    task.add_done_callback(_background.discard)


async def prefill_or_cancel(backends: "Backends", metrics: Metrics, index: int, transfer_id: str,
                            request_id: str, aw: Awaitable[T]) -> T:
    """Await a prefill call (``aw``, already bounded by the deadline). When the deadline passes
    (DeadlineExceeded) or the request is cancelled (the client left), prefill worker ``index`` is
    told to stop the plan it executes for ``transfer_id``, and the exception goes on."""
    try:
        return await aw
    except (DeadlineExceeded, asyncio.CancelledError) as exc:
        if backends.cancels:
            reason = "deadline" if isinstance(exc, DeadlineExceeded) else "client_gone"
            metrics.cancels.labels("prefill", reason).inc()
            log.warning("request %s: %s during prefill; prefill-%d told to stop", request_id,
                        "deadline passed" if reason == "deadline" else "client gone", index)
            cancel_soon(backends.cancel_prefill(index, transfer_id))
        raise
