"""Cross-node by construction: a multi-node Ray cluster on this one machine
(``ray.cluster_utils.Cluster``: a head, a node with the ``prefill`` resource, a node with the
``decode`` resource), the real actors placed by those custom resources, the real router. A
composed request's prefix KV goes from the prefill node to the decode node over the chosen
transport (``auto``: NIXL here), with no fallback counted, and the per-stage timings come back."""
import asyncio

import pytest

from tests.conftest import metric

pytestmark = pytest.mark.slow      # its own multi-node Ray, by address (not the shared local one)

SKILL = ("Refund policy: customers may return unused items within 30 days of delivery for a full refund. "
         "Opened electronics can be returned within 14 days with a 15 percent restocking fee.")


def _start_cluster():
    """Head + a ``prefill`` node + a ``decode`` node. A raylet gives its dashboard agent a fixed
    15 s to write its port file and crashes otherwise (ray-project/ray#65983), which a loaded
    2-core machine can exceed: one more attempt, each started cluster shut down on failure."""
    from ray.cluster_utils import Cluster

    for attempt in (1, 2):
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            c.add_node(num_cpus=1, resources={"prefill": 1})
            c.add_node(num_cpus=1, resources={"decode": 1})
            c.wait_for_nodes(timeout=120)
            return c
        except Exception:  # a node that did not come up: this cluster is stopped, then retried once
            c.shutdown()
            if attempt == 2:
                raise


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    import ray

    from cluster.control.ray_backends import RayBackends, start_workers, stop_workers
    from kvruntime.config import ClusterConfig, WorkerConfig

    assert not ray.is_initialized()
    cfg = ClusterConfig.of(prefill=WorkerConfig(num_cpus=1, custom_resource=True),
                        decode=WorkerConfig(num_cpus=1, custom_resource=True), kv_transport="auto",
                        tier_cpu_bytes=64 << 20, data_dir=str(tmp_path_factory.mktemp("state")))
    c = _start_cluster()
    backends = None
    try:
        ray.init(address=c.address, namespace="kvnotes", log_to_driver=False)
        pre, dec = start_workers(cfg)
        backends = RayBackends(pre, dec, cfg)
        yield cfg, backends
    finally:
        monitor = getattr(backends, "_monitor", None)       # the router's health thread: stop it before Ray goes
        if monitor is not None:
            monitor.stopped.set()
            monitor.join(30)
        try:
            if ray.is_initialized():
                stop_workers(cfg)
        finally:
            ray.shutdown()
            c.shutdown()


def test_composed_request_crosses_nodes_over_nixl_without_fallback(multinode, smol, tmp_path):
    import ray

    from cluster.control.metrics import Metrics
    from cluster.control.registry import Registry
    from cluster.control.render import Renderer
    from cluster.control.lifecycle import Finished
    from cluster.control.context import RequestContext
    from cluster.control.router import Router
    from cluster.control.router_sections import ModelSection
    from cluster.control.state import open_state
    from kvruntime.messages.decode import SamplingParams, TokenEvent

    cfg, backends = multinode
    pinfo = ray.get(backends.prefill_actors[0].ready.remote())
    dinfo = ray.get(backends.decode_actors[0].ready.remote())
    head = ray.get_runtime_context().get_node_id()
    assert pinfo["node_id"] and dinfo["node_id"] and len({pinfo["node_id"], dinfo["node_id"], head}) == 3
    ep = backends.endpoints[0]
    assert ep.node_id == dinfo["node_id"] and ep.transport == "nixl" and dinfo["transport_fallback"] is None
    assert not ep.grpc_address.startswith("0.0.0.0")        # advertises the node's address, not a wildcard
    node_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == dinfo["node_id"])
    assert ep.grpc_address.rsplit(":", 1)[0] == node_ip

    state = open_state(f"sqlite:///{tmp_path}/state.db")
    router = Router(backends, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                    ModelSection("m", cfg.workers.dtype), metrics=Metrics())

    async def run():
        await router.register_chunk("skill", "default", "refund", SKILL)
        toks, fin = [], None
        async for ev in router.stream_native(RequestContext.local(policy="fast"),
                                             [{"text": "Notes.\n"}, {"skill": "refund"},   # not first: repositioned
                                              {"text": "Can I return headphones?"}], session=None,
                                             sampling=SamplingParams(max_tokens=8, temperature=0)):
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            else:
                fin = ev
        return toks, fin

    toks, fin = asyncio.run(run())
    assert isinstance(fin, Finished) and len(toks) > 0
    assert fin.plan.kind.value == "reposition"                                   # a composed prefix
    assert fin.fallbacks == () and fin.transport == "nixl"
    assert fin.summary.loaded_tokens == fin.plan.prefix_tokens > 0               # decode used the shipped block
    stages = dict(fin.stages)
    assert {"tier_get", "rerotate", "serialise", "transfer", "receive", "load", "first_token"} <= set(stages)
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_fallbacks_total") == 0             # every known reason exported, all zero
    assert metric(text, "kvnotes_kv_transfer_bytes_total", transport="nixl") > 0
    assert metric(text, "kvnotes_stage_seconds_count", stage="transfer", transport="nixl") == 1
    inbox = ray.get(backends.decode_actors[0].inbox_stats.remote())
    assert inbox["held_bytes"] == 0 and inbox["refused"] == {} and inbox["grants"] == 0
