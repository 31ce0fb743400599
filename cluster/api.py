"""HTTP handlers over a :class:`~cluster.router.Router`: OpenAI-compatible completions and chat
completions (SSE streaming too), the native ``/v1/notes/completions``, and registration of
skills, memories and templates. Framework glue (Ray Serve + FastAPI) lives in
``cluster.serve_app``; these functions take parsed JSON and return Starlette responses.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.errors import RequestError
from cluster.router import Finished, Router
from cluster.validate import (chat_messages, common_options, completions_prompt, edit_strategy, native_body,
                              sampling_from)
from kvruntime.messages.decode import TokenEvent

log = logging.getLogger(__name__)


def error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, RequestError):
        return JSONResponse(exc.to_json(), status_code=exc.status)
    log.exception("internal error")
    return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error",
                                   "param": None, "code": None}}, status_code=500)


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.summary.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.summary.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _kvnotes(fin: Finished, explain: bool) -> dict:
    out = {"plan": fin.plan.kind.value, "ttft_s": round(fin.ttft_s, 6), "fallbacks": list(fin.fallbacks)}
    if explain:
        out["explain"] = {**fin.plan.explain(), "transport": fin.transport,
                          "stages": {k: round(v, 6) for k, v in fin.stages}}
    return out


async def _primed(gen):
    """Pull the first event before answering, so validation errors raised while planning
    become a 4xx response instead of a broken stream."""
    first = await gen.__anext__()
    return first, gen


async def _collect(first, gen) -> tuple[str, Finished]:
    text, ev = "", first
    while True:
        if isinstance(ev, TokenEvent):
            text += ev.text
        else:
            return text, ev
        ev = await gen.__anext__()


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def openai_complete(router: Router, body, tenant: str, *, chat: bool) -> Response:
    try:
        model = router.renderer.spec.name
        policy, stream, explain = common_options(body, model)
        sampling = sampling_from(body, default_max_tokens=16, limit=router.max_tokens_limit)
        if chat:
            msgs = chat_messages(body)
            ids = list(router.renderer.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
        else:
            ids = completions_prompt(body, router.renderer.encode)
            bos = router.renderer.bos_id
            if router.renderer.spec.prepend_bos and bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
        vocab = len(router.renderer.tok)
        if any(t >= vocab for t in ids):
            raise RequestError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        first, gen = await _primed(router.stream_prompt(tenant, ids, policy=policy, sampling=sampling))
    except Exception as exc:  # every failure becomes an error response (logged if ours)
        return error_response(exc)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    if not stream:
        try:
            text, fin = await _collect(first, gen)
        except Exception as exc:
            return error_response(exc)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": fin.summary.finish_reason} if chat else
                  {"index": 0, "text": text, "finish_reason": fin.summary.finish_reason, "logprobs": None})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                             "usage": _usage(fin), "kvnotes": _kvnotes(fin, explain)})

    async def events():
        ev = first
        try:
            while True:
                if isinstance(ev, TokenEvent):
                    if chat:
                        delta = {"role": "assistant", "content": ev.text} if ev.index == 0 else {"content": ev.text}
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                    else:
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [{"index": 0, "text": ev.text, "finish_reason": None, "logprobs": None}]})
                else:
                    end = ({"index": 0, "delta": {}, "finish_reason": ev.summary.finish_reason} if chat else
                           {"index": 0, "text": "", "finish_reason": ev.summary.finish_reason, "logprobs": None})
                    yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": model, "choices": [end], "usage": _usage(ev),
                                "kvnotes": _kvnotes(ev, explain)})
                    break
                ev = await gen.__anext__()
        except Exception as exc:  # mid-stream failure: report it in-band, then end the stream
            log.exception("stream %s failed", rid)
            yield _sse({"error": {"message": f"internal error: {exc}", "type": "server_error"}})
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def notes_complete(router: Router, body, tenant: str) -> Response:
    try:
        policy, stream, explain = common_options(body, router.renderer.spec.name)
        segments, session = native_body(body)
        sampling = sampling_from(body, default_max_tokens=64, limit=router.max_tokens_limit)
        first, gen = await _primed(router.stream_native(tenant, segments, policy=policy, session=session,
                                                        sampling=sampling, edit=edit_strategy(body)))
    except Exception as exc:
        return error_response(exc)
    rid = "notes-" + uuid.uuid4().hex[:24]
    if not stream:
        try:
            text, fin = await _collect(first, gen)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"id": rid, "object": "notes.completion", "model": router.renderer.spec.name,
                             "text": text, "finish_reason": fin.summary.finish_reason, "usage": _usage(fin),
                             **_kvnotes(fin, explain)})

    async def events():
        ev = first
        try:
            while True:
                if isinstance(ev, TokenEvent):
                    yield _sse({"id": rid, "token": ev.text, "index": ev.index})
                else:
                    yield _sse({"id": rid, "finish_reason": ev.summary.finish_reason, "usage": _usage(ev),
                                **_kvnotes(ev, explain)})
                    break
                ev = await gen.__anext__()
        except Exception as exc:
            log.exception("stream %s failed", rid)
            yield _sse({"error": {"message": f"internal error: {exc}", "type": "server_error"}})
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def register(router: Router, kind: str, body, tenant: str) -> Response:
    try:
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        name, text = body.get("name"), body.get("text")
        if not isinstance(name, str) or not name.strip() or len(name) > 128:
            raise RequestError(400, "name must be a non-empty string of at most 128 characters", param="name")
        if kind == "template":
            extra = set(body) - {"name", "text", "labels"}
            if extra:
                raise RequestError(400, f"unknown field(s): {', '.join(sorted(extra))}")
            t = router.registry.add_template(tenant, name, text, body.get("labels"))
            return JSONResponse({"name": t.name, "kind": "template", "fields": list(t.fields), "version": t.version},
                                status_code=201)
        extra = set(body) - {"name", "text"}
        if extra:
            raise RequestError(400, f"unknown field(s): {', '.join(sorted(extra))}")
        return JSONResponse(await router.register_chunk(kind, tenant, name, text), status_code=201)
    except Exception as exc:
        return error_response(exc)


async def listing(router: Router, kind: str, tenant: str) -> Response:
    try:
        if kind == "template":
            items = [{"name": t.name, "fields": list(t.fields), "version": t.version}
                     for t in router.registry.templates(tenant)]
        else:
            items = await router.listing(kind, tenant)
    except Exception as exc:
        return error_response(exc)
    return JSONResponse({"object": "list", "data": items})


async def delete(router: Router, kind: str, name: str, tenant: str) -> Response:
    try:
        if kind == "template":
            router.registry.remove_template(tenant, name)
            return JSONResponse({"name": name, "kind": kind, "deleted": True})
        return JSONResponse(await router.delete_chunk(kind, tenant, name))
    except Exception as exc:
        return error_response(exc)
