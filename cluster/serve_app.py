"""The router as a Ray Serve application with a FastAPI ingress. Replicas are stateless
(``router_replicas`` in config): registrations, templates, sessions and the prompt index live in
the state store every replica opens. Routes are thin: each hands parsed JSON to ``cluster.api``.
"""

import json
import logging

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response

from cluster import api
from kvruntime.messages.config import ClusterConfig
from cluster.errors import RequestError

log = logging.getLogger(__name__)
app = FastAPI(title="kvnotes", description="KV cache as notes: compose and edit.")
TENANT_HEADER = "x-kvnotes-tenant"
REPLICA_HEADER = "x-kvnotes-replica"     # which stateless router replica answered (debugging, tests)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:            # outside a Serve replica (unit tests): no replica id to report
        return "local"


@app.middleware("http")
async def _tag_replica(request: Request, call_next):
    response = await call_next(request)
    response.headers[REPLICA_HEADER] = _replica_id()
    return response


async def _json(request: Request):
    body = await request.body()
    if not body:
        raise RequestError(400, "empty request body: send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None


@serve.deployment(name="kvnotes-router", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=64)
@serve.ingress(app)
class RouterIngress:
    def __init__(self, cfg: ClusterConfig):
        from cluster.ray_backends import RayBackends
        from cluster.registry import Registry
        from cluster.render import Renderer
        from cluster.router import Router
        from cluster.shadow import ShadowConfig
        from cluster.state import StoreLimits, open_state
        from kvruntime.checkpoint import ensure_checkpoint
        from kvruntime.fidelity.report import load_summary
        from kvruntime.models import get_model_spec
        import transformers

        self.cfg = cfg
        spec = get_model_spec(cfg.model)
        ckpt = ensure_checkpoint(spec)
        tok = transformers.AutoTokenizer.from_pretrained(ckpt)
        backends = RayBackends.from_names(cfg)
        self.state = open_state(cfg.resolved_state_url, StoreLimits(cfg.session_ttl_s, cfg.session_max,
                                                                    cfg.prompt_index_ttl_s, cfg.prompt_index_max))
        self.router = Router(backends, Renderer(tok, spec, Registry(self.state), tok.bos_token_id), self.state,
                             ckpt.name, cfg.dtype,
                             default_policy=cfg.default_policy, seam_tokens=cfg.seam_tokens,
                             fidelity_summary=load_summary(cfg.model), context_window=spec.context_window,
                             max_tokens_limit=cfg.max_tokens_limit, default_tenant=cfg.tenant,
                             balanced_min_top1=cfg.balanced_min_top1, fast_min_top1=cfg.fast_min_top1,
                             shadow=ShadowConfig(cfg.shadow_fraction, frozenset(cfg.shadow_opt_out_tenants),
                                                 cfg.shadow_max_in_flight, cfg.shadow_window,
                                                 cfg.shadow_min_samples, cfg.shadow_demote_s))
        for info in backends.ready:
            self.router.metrics.rope_self_test.labels(info["worker"]).set(1 if info["rope_self_test_ok"] else 0)
        log.info("router up: model %s, edit plans by %s; compose by fidelity target: %s", cfg.model,
                 self.router.edit_choice, self.router.fidelity["compose"])

    def _tenant(self, request: Request) -> str:
        return request.headers.get(TENANT_HEADER) or self.cfg.tenant

    async def _body_or_error(self, request: Request):
        try:
            return await _json(request), None
        except RequestError as exc:
            return None, api.error_response(exc)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.cfg.model})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        import time
        for kind, n in self.state.sizes(time.time()).items():
            self.router.metrics.state_entries.labels(kind).set(n)
        return Response(self.router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.cfg.model, "object": "model", "owned_by": "kvnotes"}]})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.openai_complete(self.router, body, self._tenant(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.openai_complete(self.router, body, self._tenant(request), chat=True)

    @app.post("/v1/notes/completions")
    async def notes(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.notes_complete(self.router, body, self._tenant(request))

    @app.post("/v1/skills")
    async def add_skill(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.register(self.router, "skill", body, self._tenant(request))

    @app.post("/v1/memories")
    async def add_memory(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.register(self.router, "memory", body, self._tenant(request))

    @app.post("/v1/templates")
    async def add_template(self, request: Request) -> Response:
        body, err = await self._body_or_error(request)
        return err or await api.register(self.router, "template", body, self._tenant(request))

    @app.get("/v1/skills")
    async def list_skills(self, request: Request) -> Response:
        return await api.listing(self.router, "skill", self._tenant(request))

    @app.get("/v1/memories")
    async def list_memories(self, request: Request) -> Response:
        return await api.listing(self.router, "memory", self._tenant(request))

    @app.get("/v1/templates")
    async def list_templates(self, request: Request) -> Response:
        return await api.listing(self.router, "template", self._tenant(request))

    @app.delete("/v1/skills/{name}")
    async def del_skill(self, name: str, request: Request) -> Response:
        return await api.delete(self.router, "skill", name, self._tenant(request))

    @app.delete("/v1/memories/{name}")
    async def del_memory(self, name: str, request: Request) -> Response:
        return await api.delete(self.router, "memory", name, self._tenant(request))

    @app.delete("/v1/templates/{name}")
    async def del_template(self, name: str, request: Request) -> Response:
        return await api.delete(self.router, "template", name, self._tenant(request))
