"""A second path to a worker's ``health()``: a small actor of the router replica's own (no CPU,
threaded) that calls it from its own process. Ray orders the actor tasks of one caller
(ray-project/ray#52825: across concurrency groups too; #60850: behind cancelled ones), so a router
replica whose health calls to a worker are stuck behind its own cancelled or long-running calls
would keep a live worker marked down; calls from this actor have their own order and it never
cancels anything. :class:`cluster.control.health.HealthMonitor` asks it whenever the replica's
own health call to a worker is overdue, and marks the worker down only when neither path answers.
The admission exchange (:mod:`cluster.control.exchange`) goes through it too, for the same reason:
a replica's own call could wait behind its running prefill plans.
"""
from __future__ import annotations

PROBE_GROUP = "probe"            # the actors' concurrency group for health() and endpoint(): nothing else runs there


class HealthProber:
    def probe(self, actor, timeout_s: float) -> dict:
        """``actor.health()`` as seen from here (raises when it is gone or does not answer in time)."""
        import ray
        return ray.get(actor.health.options(concurrency_group=PROBE_GROUP).remote(), timeout=timeout_s)

    def exchange(self, actor, report, timeout_s: float) -> dict[str, int]:
        """``actor.queues(report)`` (a prefill worker): every replica's queue it holds, this one's included."""
        import ray
        return ray.get(actor.queues.options(concurrency_group=PROBE_GROUP).remote(report), timeout=timeout_s)


def start_prober():
    """A fresh prober actor owned by the calling process (it ends with it)."""
    import ray
    return ray.remote(num_cpus=0, max_concurrency=32)(HealthProber).options(
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
