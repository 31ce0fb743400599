"""``/v1/responses``, as vLLM serves it: ``POST`` runs a Responses body as a chat request
(``cluster.http.responses_body`` translates it; ``cluster.http.completion`` prepares and runs it
on the router's chat path, prompt index and all) and answers a ``response`` object, or its
event stream (``cluster.http.responses_stream``); ``GET`` / ``DELETE /v1/responses/{id}`` read
and remove a stored one.

With ``store`` (the default) the answer is kept in the state store under the tenant
(``put_response``: expiring, bounded, ``cluster.control.state``) with its conversation (the
input and output as chat messages, without ``instructions``), so a later request's
``previous_response_id`` continues it. A response id is ``resp_`` + the request id.
"""
from __future__ import annotations

import json
import time

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.control.context import RequestContext
from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits
from cluster.control.router import Router
from cluster.http.choices import Answer
from cluster.http.completion import drain, prepare, start, tail
from cluster.http.responses_body import responses_request
from cluster.http.responses_shape import Shape, keep
from cluster.http.responses_stream import events

MAX_ID_CHARS = 200


def _check_id(response_id: str) -> str:
    if not isinstance(response_id, str) or not 0 < len(response_id) <= MAX_ID_CHARS:
        raise RequestError(400, f"a response id is 1-{MAX_ID_CHARS} characters", param="response_id")
    return response_id


def _not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(404, f"response {response_id[:MAX_ID_CHARS]!r} is not stored here (never stored, expired "
                             "or deleted)", code="response_not_found", param=param)


async def _stored(router: Router, tenant: str, response_id: str, param: str | None = None) -> dict:
    data = await anyio.to_thread.run_sync(router.state.get_response, tenant, _check_id(response_id), time.time())
    if data is None:
        raise _not_found(response_id, param)
    return json.loads(data)


async def create(router: Router, limits: RequestLimits, body: dict, ctx: RequestContext) -> Response:
    """``POST /v1/responses``."""
    tenant, rid = ctx.tenant, ctx.request_id
    spec = responses_request(body, limits, default_max_tokens=limits.max_tokens)
    prior: list[dict] = []
    if spec.previous_response_id is not None:
        prior = (await _stored(router, tenant, spec.previous_response_id, "previous_response_id"))["messages"]
    head = [{"role": "system", "content": spec.instructions}] if spec.instructions else []
    prep = await prepare(router, limits, {**spec.chat, "messages": head + prior + list(spec.new_messages)}, chat=True)
    (stream,) = await start(router, ctx, prep)
    shape = Shape(router, spec, prep, rid)
    if spec.stream:
        return StreamingResponse(events(router, tenant, shape, prior, stream), media_type="text/event-stream")
    ((evs, fin),) = await drain([stream])
    sent = "".join(e.text for e in evs)
    content, calls, _ = Answer(prep.tools).whole(sent + tail(sent, fin), fin.summary.finish_reason)
    obj = shape.obj(shape.output(content, calls), fin, prep.req.explain)
    await keep(router, tenant, shape, obj, shape.conversation(prior, content, calls))
    return JSONResponse(obj)


async def retrieve(router: Router, response_id: str, tenant: str) -> Response:
    """``GET /v1/responses/{id}``: the stored response object."""
    return JSONResponse((await _stored(router, tenant, response_id))["response"])


async def delete(router: Router, response_id: str, tenant: str) -> Response:
    """``DELETE /v1/responses/{id}``."""
    gone = await anyio.to_thread.run_sync(router.state.delete_response, tenant, _check_id(response_id))
    if not gone:
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})

