"""What ``/health`` and ``/ready`` show, and to whom; ``/docs`` and ``/openapi.json`` behind a switch.

The open view (no key) is status and counts only: live and total workers per role, whether the
state store answers, the queue length and predicted wait of the replica that answered, whether a
fidelity profile was measured, the number of health sweeps. No tenant, no worker PID or name,
no path, no error text. A request that authenticates (an API key; every request when ``auth:
false``) sees the details: workers with their PIDs and state, the model's checkpoint and
profile paths, the state store's error, the fidelity view, and of the admission queue its own
tenant's entry only (``by_tenant`` holds the caller's tenant and nothing else).

``docs: true`` in the server config serves FastAPI's ``/docs`` and ``/openapi.json``; off (the
default) both are a 404 like any unknown route.
"""
from __future__ import annotations

from starlette.responses import HTMLResponse, JSONResponse, Response

from cluster.control.errors import RequestError
from cluster.control.state import StateStoreUnavailable


def open_workers(snap: dict) -> dict:
    """Per role: live and total counts only."""
    return {role: {"live": v["live"], "total": v["total"]} for role, v in snap.items()}


def open_admission(adm: dict) -> dict:
    return {"queued": adm.get("queued", 0), "predicted_wait_s": adm.get("predicted_wait_s", 0.0)}


def own_admission(adm: dict, tenant: str) -> dict:
    """The admission snapshot with ``by_tenant`` cut to the caller's own tenant."""
    mine = adm.get("by_tenant", {}).get(tenant, 0)
    return {**adm, "by_tenant": {tenant: mine} if mine else {}}


def health_body(status: str, *, snap: dict, store: dict, admission: dict, model: dict, fidelity,
                tenant: str | None) -> dict:
    """``/health``'s JSON: the open view when ``tenant`` is None, else the caller's details."""
    if tenant is None:
        return {"status": status, "model": {"name": model.get("name"), "calibrated": model.get("calibrated")},
                "workers": open_workers(snap), "state_store": {"up": store.get("up")},
                "admission": open_admission(admission)}
    return {"status": status, "model": model, "workers": snap, "state_store": store,
            "admission": own_admission(admission, tenant), "fidelity": fidelity}


def ready_body(ok: bool, *, served: str, sweeps: int, store: dict, tenant: str | None) -> dict:
    body = {"ready": ok, "model": served, "health_sweeps": sweeps}
    body["state_store"] = store if tenant is not None else {"up": store.get("up")}
    return body


async def caller(auth, request) -> str | None:
    """The caller's tenant when the request authenticates (auth off: the default tenant), else
    None: a missing or refused key, or a state store that cannot check it, gets the open view,
    never an error (probes send no key)."""
    if not auth.enabled:
        return auth.default_tenant
    if not request.headers.get("authorization"):
        return None
    try:
        return await auth.of_request(request)
    except (RequestError, StateStoreUnavailable):      # a refused key, or a store that cannot say: the open view
        return None


def docs_response(enabled: bool, app, path: str) -> Response:
    """``/openapi.json`` or ``/docs`` when ``docs: true``; else a 404 RequestError."""
    if not enabled:
        raise RequestError(404, f"no route {path} (the server config's docs: true serves it)")
    if path.endswith("openapi.json"):
        return JSONResponse(app.openapi())
    from fastapi.openapi.docs import get_swagger_ui_html
    html = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API")
    return HTMLResponse(html.body.decode())
