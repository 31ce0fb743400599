"""What every route of the router's HTTP app shares at its edge (:mod:`cluster.http.serve_app`):
the replica tag on every response, the request id on error responses, a body's own deadline for
admission, and the Prometheus service-discovery groups of ``/metrics/targets``."""
from __future__ import annotations

from ray import serve
from starlette.responses import Response

from cluster.control.errors import RequestError
from cluster.http import validate
from cluster.http.ids import REQUEST_ID_HEADER

REPLICA_HEADER = "x-kvnotes-replica"     # which stateless router replica answered (debugging, tests)


def ray_metrics_nodes() -> list[tuple[str, str]]:
    """(``ray-node-<id>``, ``host:port``) of every live Ray node's metrics agent."""
    import ray
    return [(f"ray-node-{n['NodeID'][:12]}", f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}")
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:            # outside a Serve replica (unit tests): no replica id to report
        return "local"


class TagReplica:
    """Adds ``x-kvnotes-replica`` to every response. Plain ASGI (a ``@app.middleware("http")``
    function would pipe every streamed response through an extra task and memory stream)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REPLICA_HEADER.encode(), replica_id().encode())]}
            await send(message)
        await self.app(scope, receive, tagged)


def with_id(resp: Response, rid: str, set_header: bool) -> Response:
    """``resp`` with the request's id in ``x-request-id`` (where the Serve proxy does not echo it)."""
    if set_header:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def deadline(body) -> float | None:
    """The request's own ``deadline_s`` for admission (an invalid one is the handler's 400)."""
    try:
        return validate.deadline_s(body) if isinstance(body, dict) else None
    except RequestError:
        return None


def target_groups(announced: dict[str, str], workers: dict, nodes: list[tuple[str, str]]) -> list[dict]:
    """``http_sd_configs`` groups: every router replica announced (name -> host:port), every
    worker with a metrics endpoint (``workers``: role -> the view's workers) and each Ray node's
    metrics agent (Ray Serve's own series: HTTP requests, latency, queues)."""
    groups = [{"targets": [addr], "labels": {"kvnotes_role": "router", "kvnotes_process": name}}
              for name, addr in announced.items()]
    for role, ws in workers.items():
        groups += [{"targets": [w.metrics], "labels": {"kvnotes_role": role, "kvnotes_process": f"{role}-{i}"}}
                   for i, w in enumerate(ws) if w.metrics]
    groups += [{"targets": [addr], "labels": {"kvnotes_role": "ray", "kvnotes_process": name}} for name, addr in nodes]
    return groups
