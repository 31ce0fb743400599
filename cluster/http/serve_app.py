"""The router as a Ray Serve application with a FastAPI ingress. Replicas are stateless
(``router_replicas`` in config): registrations, templates, sessions and the prompt index live in
the state store every replica opens. The router and its collaborators are built by
``cluster.control.assembly``; this module only serves them. Routes are thin:
:meth:`RouterIngress._call` gives each request its one id (``cluster.http.ids``: the client's
``x-request-id`` when well-formed), binds it for the request's log lines, authenticates it
(``cluster.http.auth``: the tenant comes from the API key), reads the body within the limits
(``cluster.http.body``), holds a per-tenant in-flight slot, and hands parsed JSON to
``cluster.http.api``. ``/health``, ``/ready`` and ``/metrics`` need no key (``/health`` and ``/ready``
then show status and counts only: ``cluster.http.health_view``; ``/docs`` only with ``docs: true``);
``/metrics/targets`` needs one with ``metrics_auth: true``. A state store
that does not answer is a 503 ``state_store_unavailable`` with ``Retry-After`` (``cluster.http.errors``),
``/ready`` 503 and ``/health`` ``degraded`` (``cluster.control.state.watch``).
"""

import asyncio
import logging
import threading
import time

import anyio
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.http import api, edge, heap, health_view, responses, validate
from cluster.http.edge import REPLICA_HEADER, TagReplica as _TagReplica  # noqa: F401  re-exported (tests, benches)
from cluster.control.errors import RequestError
from cluster.control.context import OutcomeRecord, RequestContext, StageClock
from cluster.control.state import StateStoreUnavailable
from cluster.http.errors import error_response
from cluster.http.ids import request_id
from cluster.control.limits import RequestLimits
from cluster.http.body import read_json
from cluster.control import metrics as request_metrics      # a module reference: Serve pickles this app
from kvruntime import request_log
from kvruntime.config import ClusterConfig

log = logging.getLogger(__name__)
app = FastAPI(title="kvnotes", description="KV cache as notes: compose and edit.",
              docs_url=None, redoc_url=None, openapi_url=None)   # served by config (cluster.http.health_view)
TARGET_REFRESH_S = 5.0                   # each replica re-announces its metrics endpoint this often
TARGET_TTL_S = 30.0                      # and a replica silent this long drops out of /metrics/targets


app.add_middleware(edge.TagReplica)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown routes and wrong methods: OpenAI-shaped too."""
    msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    rid, echo = request_id(request.headers)
    return edge.with_id(error_response(RequestError(exc.status_code, msg.get(exc.status_code, str(exc.detail))), rid),
                    rid, echo)


# max_ongoing_requests / max_queued_requests: from the config (cluster.operator.launcher), Serve's own
# queue bounded; admission (cluster.control.admission) sheds before it fills
@serve.deployment(name="kvnotes-router", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class RouterIngress:
    def __init__(self, cfg: ClusterConfig):
        from cluster.control.assembly import assemble, wire_admission
        from cluster.http.auth import Authenticator
        from cluster.http.body import InflightLimiter
        from kvruntime.fidelity.profiles import calibration_line
        from kvruntime.telemetry import listen_host, start_exporter

        request_log.install(worker=True)     # every log line of a request carries its id
        from kvruntime.cpu_priority import check_control_plane
        check_control_plane(cfg.workers.model_niceness)   # a warning if this replica is no higher than the model
        self.cfg = cfg
        heap.configure()            # large bodies go back to the system when freed (cluster.http.heap)
        built = assemble(cfg)       # the router and its collaborators (cluster.control.assembly)
        self.router, self.state, self.store_watch = built.router, built.state, built.store_watch
        self.profile, self.served = built.profile, built.served
        self.auth = Authenticator(self.state, enabled=cfg.server.auth, default_tenant=cfg.server.tenant,
                                  trusted_proxies=cfg.server.trusted_proxies, cache_s=cfg.server.auth_cache_s,
                                  unknown_cache_s=cfg.server.unknown_key_cache_s,
                                  unknown_rate_per_s=cfg.server.unknown_key_rate_per_s,
                                  unknown_burst=cfg.server.unknown_key_burst, registry=self.router.metrics.registry)
        self.limits = RequestLimits.from_config(cfg)
        self.inflight = InflightLimiter(cfg.server.max_inflight_per_tenant)
        # this replica's own metrics endpoint, announced in the state store so that /metrics/targets
        # (Prometheus' service discovery) lists every replica, not the one the proxy picked
        self.process = f"router-{edge.replica_id()}"
        wired = wire_admission(cfg, self.router, self.process)     # cluster.control.assembly
        self.admission, self.exchange = wired.admission, wired.exchange
        self.metrics_target = start_exporter(self.router.metrics.registry, host=listen_host(cfg.server.bind_host))
        threading.Thread(target=self._announce, name="kvnotes-metrics-announce", daemon=True).start()
        (log.info if self.profile.calibrated else log.warning)("%s", calibration_line(self.profile, cfg.workers.model))
        log.info("router up: model %s (%s), edit plans by %s; compose by fidelity target: %s", self.served,
                 self.router.renderer.spec.name, self.router.edit_choice, self.router.fidelity["compose"])

    def _announce(self) -> None:
        """Every TARGET_REFRESH_S: refresh this replica's target and the state-size gauges."""
        while True:
            try:
                now = time.time()
                self.state.put_target(self.process, self.metrics_target, now)
                for kind, n in self.state.sizes(now).items():
                    self.router.metrics.state_entries.labels(kind).set(n)
                seen = self.state.registrations_by_tier()
                for kind in ("skill", "memory"):
                    for in_tier in ("true", "false", "unknown"):
                        self.router.metrics.registrations_tier.labels(kind, in_tier).set(seen.get((kind, in_tier), 0))
            except Exception as exc:      # the state store is down: logged, retried next period
                log.warning("announcing the metrics target failed: %s", exc)
            time.sleep(TARGET_REFRESH_S)

    async def _call(self, request: Request, handler, *, body: bool = True, admit: bool = False) -> Response:
        """Run ``handler(body, ctx)`` for an authenticated request within the limits, ``ctx`` its
        :class:`~cluster.control.context.RequestContext` (made here, once); every failure becomes an
        OpenAI-shaped error carrying the request id. ``admit``: a generation request, admitted or
        shed by ``cluster.control.admission`` before any work."""
        clock = StageClock()                     # explain.control: this request's control-path laps
        rid, echo = request_id(request.headers)  # the one id of this request (cluster.http.ids)
        request_log.REQUEST_ID.set(rid)          # on every log line of it, here and in the actors
        record = OutcomeRecord()                 # the router marks it when it counts the final status
        try:
            record.tenant = await self.auth.of_request(request)      # the store read off the event loop
            self.inflight.acquire(record.tenant)
        except Exception as exc:
            return edge.with_id(self._counted(error_response(exc, rid), record), rid, echo)
        clock.lap("http_auth")
        ctx, streaming = RequestContext(rid, record.tenant, clock=clock, outcome=record), False
        try:
            if admit:                    # before the body: a refused request never waits for it
                ctx = await self._admit(ctx)
            parsed = await read_json(request, self.limits) if body else None
            clock.lap("http_body")
            if admit:
                self._within_deadline(ctx, parsed)
            resp = await handler(parsed, ctx)
            if isinstance(resp, StreamingResponse):       # the slot is held until the stream ends
                resp.body_iterator = self._release_after(resp.body_iterator, ctx)
                streaming = True
        except asyncio.CancelledError:        # the client left before a response: counted, once
            if not record.counted:
                self.router.metrics.count_request(record.plan_label, "cancelled", record=record)
            raise
        except Exception as exc:
            resp = error_response(exc, rid)
        finally:
            if ctx.ticket is not None:
                ctx.ticket.release()              # out of the admission queue (a no-op after the first token)
            if not streaming:
                self.inflight.release(ctx.tenant)
        if body and int(request.headers.get("content-length") or 0) >= heap.LARGE_BODY_BYTES and resp.background is None:
            resp.background = BackgroundTask(anyio.to_thread.run_sync, heap.trim)    # once the response is sent
        return edge.with_id(resp if streaming else self._counted(resp, record), rid, echo)

    async def _admit(self, ctx: RequestContext) -> RequestContext:
        """``ctx`` with its admission ticket; refused: shed (its outcome), the caller answers the error."""
        ctx.outcome.shed = True                  # until admitted
        ticket = await self.exchange.admit(ctx.tenant)
        ctx.outcome.shed = False
        ctx.lap("admission")
        return ctx.admitted(ticket)

    def _within_deadline(self, ctx: RequestContext, parsed) -> None:
        """The request's own ``deadline_s`` only refuses more (``Admission.within_deadline``)."""
        deadline = edge.deadline(parsed)
        if deadline is not None:
            ctx.outcome.shed = True
            self.admission.within_deadline(ctx.ticket, deadline)
            ctx.outcome.shed = False

    def _counted(self, resp: Response, record: OutcomeRecord) -> Response:
        """Count a request the router did not (it never reached a plan: auth, limits, bad input,
        listing and registration routes), once, by its HTTP status."""
        if not record.counted:
            self.router.metrics.count_request("none", request_metrics.status_label(resp.status_code), record=record)
        return resp

    async def _release_after(self, it, ctx: RequestContext):
        try:
            async for chunk in it:
                yield chunk
        finally:
            self.inflight.release(ctx.tenant)
            if not ctx.outcome.counted:       # the stream ended before the router counted it: the client left
                self.router.metrics.count_request(ctx.outcome.plan_label, "cancelled", record=ctx.outcome)

    @app.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """Liveness now: live workers per role (the router's health view), 503 when a role has none;
        ``degraded`` (still 200) while a role has lost any of its workers or the state store does
        not answer. Without a key: status and counts only; with one, the details, the admission
        queue's own tenant only (``cluster.http.health_view``)."""
        snap = self.router.view.snapshot()
        ok = all(v["live"] > 0 for v in snap.values())
        whole = all(v["live"] == v["total"] for v in snap.values())
        store = self.store_watch.snapshot()
        status = "unavailable" if not ok else "ok" if store["up"] and whole else "degraded"
        body = health_view.health_body(status, snap=snap, store=store, admission=self.admission.snapshot(),
                                       model=self._model_block(), fidelity=self.router.fidelity,
                                       tenant=await health_view.caller(self.auth, request))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready(self, request: Request) -> JSONResponse:
        """Ready for traffic: start-up finished (this replica is constructed and its first health
        sweep is done) and the state store answers (503 while it does not)."""
        sweeps = self.router.backends.health_sweeps
        store = self.store_watch.snapshot()
        ok = sweeps > 0 and store["up"]
        body = health_view.ready_body(ok, served=self.served, sweeps=sweeps, store=store,
                                      tenant=await health_view.caller(self.auth, request))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        return await self._docs(request)

    @app.get("/docs")
    async def docs(self, request: Request) -> Response:
        return await self._docs(request)

    async def _docs(self, request: Request) -> Response:
        """``/docs`` and ``/openapi.json`` only with ``docs: true`` (404 otherwise)."""
        try:
            return health_view.docs_response(self.cfg.server.docs, app, request.url.path)
        except RequestError as exc:
            rid, echo = request_id(request.headers)
            return edge.with_id(error_response(exc, rid), rid, echo)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """This replica's series only (the one the proxy picked); Prometheus should discover every
        process through /metrics/targets instead. Served during a state store outage too."""
        if self.store_watch.up:
            try:
                for kind, n in self.state.sizes(time.time()).items():
                    self.router.metrics.state_entries.labels(kind).set(n)
            except StateStoreUnavailable:
                pass                      # counted and marked down; the last sizes stay exported
        return Response(self.router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/metrics/targets")
    async def metrics_targets(self, request: Request) -> Response:
        """Prometheus HTTP service discovery (``http_sd_configs``): every router replica's and
        every worker's own metrics endpoint, labelled ``kvnotes_role`` and ``kvnotes_process``.
        With ``metrics_auth`` it needs an API key, like the API (401 without one). A 503 while
        the state store does not answer (Prometheus keeps the targets it had)."""
        try:
            if self.cfg.server.metrics_auth:
                await self.auth.of_request(request)
            announced = self.state.targets(time.time(), TARGET_TTL_S)
        except (RequestError, StateStoreUnavailable) as exc:
            rid, echo = request_id(request.headers)
            return edge.with_id(error_response(exc, rid), rid, echo)
        nodes = await asyncio.to_thread(edge.ray_metrics_nodes)
        return JSONResponse(edge.target_groups(announced, self.router.view.workers, nodes))

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def h(_, ctx):
            return JSONResponse({"object": "list", "data": [self._model_card()]})
        return await self._call(request, h, body=False)

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        async def h(_, ctx):
            if model_id != self.served:
                raise RequestError(404, f"model {model_id!r} is not served here; this server serves "
                                        f"{self.served!r}", code="model_not_found", param="model")
            return JSONResponse(self._model_card())
        return await self._call(request, h, body=False)

    def _model_card(self) -> dict:
        return {"id": self.served, "object": "model", "created": 0, "owned_by": "kvnotes"}

    def _model_block(self) -> dict:
        """``/health``'s model: the API name, the weights' id, and whether a fidelity profile was
        measured (uncalibrated: policy balanced gets exact reuse only)."""
        spec = self.router.renderer.spec
        return {"name": self.served, "id": spec.name, "checkpoint": spec.checkpoint, "dtype": self.cfg.workers.dtype,
                "calibrated": self.profile.calibrated, "profile": str(self.profile.path)}

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.openai_complete(self.router, self.limits, b, ctx,
                                                                          chat=False), admit=True)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.openai_complete(self.router, self.limits, b, ctx,
                                                                          chat=True), admit=True)

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: responses.create(self.router, self.limits, b, ctx),
                                admit=True)

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: responses.retrieve(self.router, response_id, ctx.tenant), body=False)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: responses.delete(self.router, response_id, ctx.tenant), body=False)

    @app.post("/v1/notes/completions")
    async def notes(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.notes_complete(self.router, self.limits, b, ctx),
                                admit=True)

    @app.post("/v1/skills")
    async def add_skill(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.register(self.router, self.limits, "skill", b, ctx.tenant))

    @app.post("/v1/memories")
    async def add_memory(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.register(self.router, self.limits, "memory", b, ctx.tenant))

    @app.post("/v1/templates")
    async def add_template(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.register(self.router, self.limits, "template", b, ctx.tenant))

    @app.get("/v1/skills")
    async def list_skills(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.listing(self.router, "skill", ctx.tenant), body=False)

    @app.get("/v1/memories")
    async def list_memories(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.listing(self.router, "memory", ctx.tenant), body=False)

    @app.get("/v1/templates")
    async def list_templates(self, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.listing(self.router, "template", ctx.tenant), body=False)

    @app.delete("/v1/skills/{name:path}")
    async def del_skill(self, name: str, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.delete(self.router, "skill", name, ctx.tenant), body=False)

    @app.delete("/v1/memories/{name:path}")
    async def del_memory(self, name: str, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.delete(self.router, "memory", name, ctx.tenant), body=False)

    @app.delete("/v1/templates/{name:path}")
    async def del_template(self, name: str, request: Request) -> Response:
        return await self._call(request, lambda b, ctx: api.delete(self.router, "template", name, ctx.tenant), body=False)
