"""CPU priority: the control plane before the model.

Ray starts every worker process at niceness 15 (its ``worker_niceness``), so Serve's proxy, the
router replicas and their health probers compete for the CPU on equal terms with the model
workers' forwards: on a machine whose cores the model keeps busy, every hop of a request through
the control plane waits for a time slice. Measured on the 2-core test machine (the overload test's
cluster at 4x its capacity, 60 s): refusals took p50 17 / p90 31 / max 102-106 ms with every Ray
worker process at 15; p50 14 / p90 23 / max 38 ms with the proxy, the replicas and the probers at 0.

So a local Ray that kvnotes starts runs its worker processes at ``ray_worker_niceness`` (0), and
the model worker actors (prefill, decode) lower their own priority to ``model_niceness`` (15:
where Ray would have put them) first thing in their constructor. Raising a niceness needs no
privilege; lowering one does, hence this order. A cluster started with ``ray start`` needs
``RAY_worker_niceness=0`` in that command's environment (``deploy/cluster.yaml`` sets it); a router
replica that finds itself at no higher priority than the model workers says so in its log."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def niceness() -> int:
    """The calling thread's niceness (Linux: per thread; elsewhere: the process's)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def lower_priority(to: int) -> int:
    """Every thread of this process to niceness ``to`` at least (a thread already nicer is left as
    it is); threads started later inherit their creator's. Returns the calling thread's niceness."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:             # no /proc (macOS): the process as a whole
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < to:
                os.setpriority(os.PRIO_PROCESS, tid, to)
        except ProcessLookupError:        # a thread that ended meanwhile
            pass
    return niceness()


def check_control_plane(model_niceness: int) -> None:
    """Called by a router replica: a warning when it runs at no higher priority than the model."""
    mine = niceness()
    if mine >= model_niceness:
        log.warning("this router replica runs at niceness %d, no higher CPU priority than the model workers "
                    "(model_niceness %d): under CPU load its refusals, health probes and token streams wait "
                    "behind the model's forwards; start Ray with RAY_worker_niceness=0 (a local Ray kvnotes "
                    "starts does: ray_worker_niceness)", mine, model_niceness)
