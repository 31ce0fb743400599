"""The plan-time tier lookup (``RayBackends.contains``) runs in the prefill actor's own "lookup"
concurrency group: it answers while the actor's default group is busy (an execute, a precompile, a
store-behind compile), where it queued behind them (the seconds-long ``lookup_state`` laps of the
agent-traffic run). A real local Ray actor with the workers' groups; bounded waits, no timing."""
from __future__ import annotations

import asyncio

from cluster.control.ray_backends import ACTOR_GROUPS, LOOKUP_GROUP, RayBackends
from cluster.control.routing import WorkerView
from kvruntime.config import ClusterConfig
from kvruntime.messages.plan import KVRef


def test_tier_lookup_answers_while_the_prefill_actor_runs_a_plan(local_ray):
    import ray

    from tests.conftest import _RAY, shared_ray
    shared_ray(ClusterConfig(), local_cpus=2)

    @ray.remote(num_cpus=0, concurrency_groups=ACTOR_GROUPS)
    class BusyPrefill:           # the PrefillWorker's shape: a long call in the default group
        def __init__(self):
            import threading
            self.started, self.go = threading.Event(), threading.Event()

        def execute(self) -> bool:
            self.started.set()
            return self.go.wait(120)

        def wait_started(self) -> bool:
            return self.started.wait(120)

        def release(self) -> None:
            self.go.set()

        def contains(self, refs) -> list[bool]:
            return [True for _ in refs]

    actor = BusyPrefill.remote()
    try:
        running = actor.execute.remote()
        assert ray.get(actor.wait_started.options(concurrency_group=LOOKUP_GROUP).remote(), timeout=180)
        backends = RayBackends.__new__(RayBackends)
        backends.prefill_actors, backends.num_prefill, backends.view = [actor], 1, WorkerView(1, 1)
        got = asyncio.run(asyncio.wait_for(backends.contains([KVRef((1, 2, 3), 0, "s")], 0), 120))
        assert got == [True]
        done, _ = ray.wait([running], timeout=0)
        assert not done                    # the plan was still running when the lookup answered
        ray.get(actor.release.options(concurrency_group=LOOKUP_GROUP).remote(), timeout=60)
        assert ray.get(running, timeout=60) is True
    finally:
        ray.kill(actor)
        _RAY["active"] = False        # no cluster of ours runs on the shared Ray now: the next module
        #                               that needs Ray of its own (test_node_loss) gets it shut down

