"""Every process exports its own Prometheus series on its own port.

Router replicas, prefill actors and decode actors each call :func:`start_exporter` once: a
``prometheus_client`` HTTP server on a free port of the node's address, serving that process'
registry (a decode actor running vLLM serves the process-wide default registry, where vLLM's
engine metrics ``vllm:*`` live). Nothing is aggregated in one process: Prometheus scrapes every
endpoint, found through the router's HTTP service discovery (``GET /metrics/targets``, see
``deploy/prometheus.yml``), and the dashboard sums across processes. A restarted process starts
its counters at zero, which ``rate()`` treats as a counter reset: nothing is double counted and
nothing is lost but the restarted process' unscraped last seconds.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def node_ip() -> str:
    """The node's address as Ray reports it ("127.0.0.1" outside Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray runtime here: a loopback-only exporter (tests, one process)
        pass
    return "127.0.0.1"


def start_exporter(registry=None, host: str = "127.0.0.1") -> str:
    """Serve ``registry`` (default: the process-wide one) on ``host`` at a free port; returns
    ``"host:port"`` as a Prometheus target. Raises OSError when the port cannot be bound."""
    from prometheus_client import REGISTRY, start_http_server

    server, _thread = start_http_server(0, addr=host, registry=registry if registry is not None else REGISTRY)
    port = server.server_address[1]
    target = f"{host}:{port}"
    log.info("metrics exported on http://%s/metrics", target)
    return target
