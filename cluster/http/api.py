"""HTTP handlers over a :class:`~cluster.control.router.Router`: OpenAI-compatible completions and chat
completions (SSE streaming too), the native ``/v1/notes/completions``, and registration of
skills, memories and templates. Framework glue (Ray Serve + FastAPI, auth, body limits) lives
in ``cluster.http.serve_app``; these functions take a parsed JSON object and the caller's tenant,
raise :class:`~cluster.http.errors.RequestError` for the caller's mistakes, and return Starlette
responses. Tokenization runs in a worker thread, never on the event loop. Each body is
validated once (``cluster.http.validate.native_request`` / ``openai_request``); the request's id
(``cluster.http.ids``) is the response's ``id`` after the object's prefix.
"""
from __future__ import annotations

import json
import logging
import time

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.control.errors import RequestError
from cluster.http.errors import internal_error_json
from cluster.control.routing import WorkerLost
from cluster.control.limits import RequestLimits
from cluster.control.lifecycle import Finished
from cluster.control.router import Router
from cluster.control.limits import check_name, check_text
from cluster.http.validate import native_request, openai_request
from kvruntime.messages.decode import TokenEvent

log = logging.getLogger(__name__)


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.summary.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.summary.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _kvnotes(fin: Finished, explain: bool) -> dict:
    out = {"plan": fin.plan.kind.value, "ttft_s": round(fin.ttft_s, 6), "fallbacks": list(fin.fallbacks)}
    if explain:
        out["explain"] = {**fin.plan.explain(), "transport": fin.transport,
                          "stages": {k: round(v, 6) for k, v in fin.stages}}
        if fin.clock is not None:     # control-path laps (cluster.control.lifecycle.StageClock)
            out["explain"]["control"] = fin.clock.as_json()
    return out


async def _primed(gen):
    """Pull the first event before answering, so validation errors raised while planning
    become a 4xx response instead of a broken stream."""
    first = await gen.__anext__()
    return first, gen


async def _collect(first, gen) -> tuple[list[TokenEvent], Finished]:
    evs, ev = [], first
    while not isinstance(ev, Finished):
        evs.append(ev)
        ev = await gen.__anext__()
    return evs, ev


def _tail(sent: str, fin: Finished) -> str:
    """Text the decoder held back until the end (a partial stop string or character before EOS)."""
    return fin.summary.text[len(sent):] if fin.summary.text.startswith(sent) else ""


def stream_error_json(exc: BaseException, rid: str) -> dict:
    """The in-band error event of a stream that fails after it started: the caller's mistake or a
    lost worker is said as it is (the answer so far is incomplete: send the request again); any
    other failure gives only the request id, the details go to the log under it."""
    if isinstance(exc, RequestError):
        return exc.to_json(rid)
    if isinstance(exc, WorkerLost):
        log.warning("request %s: %s", rid, exc)
        return {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "worker_lost",
                          "request_id": rid}}
    log.error("request %s: stream failed", rid, exc_info=exc)
    return internal_error_json(rid)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class _Logprobs:
    """OpenAI's log-prob shapes from :class:`TokenEvent` values (chat: ``content`` entries;
    completions: the legacy parallel lists)."""

    def __init__(self, tok, chat: bool):
        self.tok, self.chat = tok, chat

    def _t(self, i: int) -> str:
        return self.tok.decode([i])

    def of(self, evs: list[TokenEvent]) -> dict | None:
        evs = [e for e in evs if e.logprob is not None]
        if not evs:
            return None
        if self.chat:
            return {"content": [{"token": self._t(e.token_id), "logprob": e.logprob,
                                 "bytes": list(self._t(e.token_id).encode()),
                                 "top_logprobs": [{"token": self._t(i), "logprob": lp, "bytes": list(self._t(i).encode())}
                                                  for i, lp in e.top_logprobs]} for e in evs]}
        return {"tokens": [self._t(e.token_id) for e in evs], "token_logprobs": [e.logprob for e in evs],
                "top_logprobs": [{self._t(i): lp for i, lp in e.top_logprobs} for e in evs],
                "text_offset": None}


async def openai_complete(router: Router, limits: RequestLimits, body: dict, tenant: str, rid: str, *,
                          chat: bool) -> Response:
    model = router.served_model
    vocab = len(router.renderer.tok)
    req = openai_request(body, limits, model=model, vocab=vocab, chat=chat)
    stream, explain, include_usage, sampling = req.stream, req.explain, req.include_usage, req.sampling
    budget = router.budget(sampling)        # priced before tokenisation, charged while it runs
    if chat:
        # priced in the thread, before the template is applied (Renderer.chat_ids): once
        ids = await anyio.to_thread.run_sync(router.renderer.chat_ids, req.messages, budget)
    else:
        prompt = req.prompt
        if isinstance(prompt, str):
            budget.price_chars(len(prompt))
            ids = await anyio.to_thread.run_sync(budget.encode, router.renderer.encode, prompt)
        else:
            ids = prompt
        bos = router.renderer.bos_id
        if router.renderer.spec.prepend_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
    if not ids:
        raise RequestError(400, "prompt is empty after tokenization", param="prompt")
    if any(t >= vocab for t in ids):
        raise RequestError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
    first, gen = await _primed(router.stream_prompt(tenant, ids, policy=req.policy, sampling=sampling,
                                                    deadline_s=req.deadline_s, request_id=rid))
    cid = ("chatcmpl-" if chat else "cmpl-") + rid
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    lp = _Logprobs(router.renderer.tok, chat)
    if not stream:
        evs, fin = await _collect(first, gen)
        sent = "".join(e.text for e in evs)
        text = sent + _tail(sent, fin)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp.of(evs),
                   "finish_reason": fin.summary.finish_reason} if chat else
                  {"index": 0, "text": text, "finish_reason": fin.summary.finish_reason, "logprobs": lp.of(evs)})
        return JSONResponse({"id": cid, "object": obj, "created": created, "model": model, "choices": [choice],
                             "usage": _usage(fin), "kvnotes": _kvnotes(fin, explain)})

    def chunk(text: str | None, finish, evs=()) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            c = {"index": 0, "delta": delta, "logprobs": lp.of(list(evs)), "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": lp.of(list(evs)), "finish_reason": finish}
        return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model, "choices": [c]}

    async def events():
        ev, sent = first, ""
        try:
            if chat:
                head = chunk("", None)
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(head)
            while isinstance(ev, TokenEvent):
                if ev.text or ev.logprob is not None:
                    sent += ev.text
                    yield _sse(chunk(ev.text, None, [ev]))
                ev = await gen.__anext__()
            end = chunk(_tail(sent, ev) or None, ev.summary.finish_reason)
            if include_usage:
                end["usage"] = _usage(ev)
            end["kvnotes"] = _kvnotes(ev, explain)
            yield _sse(end)
        except Exception as exc:  # mid-stream failure: reported in-band, logged, the stream ends
            yield _sse(stream_error_json(exc, rid))
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def notes_complete(router: Router, limits: RequestLimits, body: dict, tenant: str, rid: str) -> Response:
    req = native_request(body, limits, model=router.served_model, vocab=len(router.renderer.tok))
    stream, explain = req.stream, req.explain
    first, gen = await _primed(router.stream_native(tenant, req.segments, policy=req.policy, session=req.session,
                                                    sampling=req.sampling, edit=req.edit, deadline_s=req.deadline_s,
                                                    request_id=rid))
    nid = "notes-" + rid
    if not stream:
        evs, fin = await _collect(first, gen)
        sent = "".join(e.text for e in evs)
        return JSONResponse({"id": nid, "object": "notes.completion", "model": router.served_model,
                             "text": sent + _tail(sent, fin), "finish_reason": fin.summary.finish_reason,
                             "usage": _usage(fin), **_kvnotes(fin, explain)})

    async def events():
        ev, sent = first, ""
        try:
            while isinstance(ev, TokenEvent):
                if ev.text:
                    sent += ev.text
                    yield _sse({"id": nid, "token": ev.text, "index": ev.index})
                ev = await gen.__anext__()
            tail = _tail(sent, ev)
            if tail:
                yield _sse({"id": nid, "token": tail, "index": ev.summary.completion_tokens})
            yield _sse({"id": nid, "finish_reason": ev.summary.finish_reason, "usage": _usage(ev),
                        **_kvnotes(ev, explain)})
        except Exception as exc:  # mid-stream failure: reported in-band, logged, the stream ends
            yield _sse(stream_error_json(exc, rid))
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def register(router: Router, limits: RequestLimits, kind: str, body: dict, tenant: str) -> Response:
    allowed = {"name", "text", "labels"} if kind == "template" else {"name", "text"}
    extra = set(body) - allowed
    if extra:
        raise RequestError(400, f"unknown field(s): {', '.join(sorted(extra))[:300]}", param=sorted(extra)[0][:64])
    name = check_name(body.get("name"), limits)
    if kind == "template":
        t = router.registry.add_template(tenant, name, body.get("text"), body.get("labels"), limits)
        return JSONResponse({"name": t.name, "kind": "template", "fields": list(t.fields), "version": t.version},
                            status_code=201)
    text = check_text(body.get("text"), limits, "text")
    return JSONResponse(await router.register_chunk(kind, tenant, name, text), status_code=201)


async def listing(router: Router, kind: str, tenant: str) -> Response:
    if kind == "template":
        items = [{"name": t.name, "fields": list(t.fields), "version": t.version}
                 for t in router.registry.templates(tenant)]
    else:
        items = await router.listing(kind, tenant)
    return JSONResponse({"object": "list", "data": items})


async def delete(router: Router, kind: str, name: str, tenant: str) -> Response:
    if len(name) > 1024:
        raise RequestError(400, "name is too long", param="name")
    if kind == "template":
        router.registry.remove_template(tenant, name)
        return JSONResponse({"name": name, "kind": kind, "deleted": True})
    return JSONResponse(await router.delete_chunk(kind, tenant, name))
