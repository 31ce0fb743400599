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

import asyncio
import dataclasses
import functools
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
from cluster.control.tools import constraint as tool_constraint, parse_tools, prepare as prepare_tools, template_takes_tools
from cluster.http.choices import Answer, call_deltas, choice_sampling, merged
from cluster.http.structured import check_schema, response_format
from cluster.http.validate import native_request, openai_request
from kvruntime.messages.decode import TokenEvent

log = logging.getLogger(__name__)


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.summary.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.summary.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _kvnotes(fin: Finished, explain: bool, extra: dict | None = None) -> dict:
    out = {"plan": fin.plan.kind.value, "ttft_s": round(fin.ttft_s, 6), "fallbacks": list(fin.fallbacks)}
    if explain:
        out["explain"] = {**fin.plan.explain(), "transport": fin.transport,
                          "stages": {k: round(v, 6) for k, v in fin.stages}, **(extra or {})}
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


def _structured(router: Router, body: dict, *, chat: bool, limits: RequestLimits):
    """(constraint, tools) of a request; counts refused schemas and constrained requests."""
    try:
        constraint = response_format(body)
        tools = parse_tools(body, check_schema) if chat else None
    except RequestError as exc:
        if exc.code == "invalid_schema":
            router.metrics.schemas_rejected.inc()
        raise
    forced = tool_constraint(tools)
    if forced is not None and constraint is not None:
        raise RequestError(400, "response_format cannot be combined with a forced tool_choice (required or a named "
                                "function): the call's arguments follow the function's parameters", param="tool_choice")
    for kind in (constraint.kind if constraint is not None else None, tools.metric_kind if tools is not None else None):
        if kind:
            router.metrics.constrained.labels(kind).inc()
    return forced or constraint, tools


async def _chain(first, gen):
    yield first
    async for ev in gen:
        yield ev


async def _drain(stream) -> tuple[list[TokenEvent], Finished]:
    return await _collect(await stream.__anext__(), stream)


def _total_usage(fins: list[Finished]) -> dict:
    """Usage of ``n`` choices: the prompt once, every choice's completion tokens."""
    u = _usage(fins[0])
    u["completion_tokens"] = sum(f.summary.completion_tokens for f in fins)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


async def openai_complete(router: Router, limits: RequestLimits, body: dict, tenant: str, rid: str, *,
                          chat: bool) -> Response:
    model = router.served_model
    vocab = len(router.renderer.tok)
    req = openai_request(body, limits, model=model, vocab=vocab, chat=chat)
    stream, explain, include_usage, n = req.stream, req.explain, req.include_usage, req.n
    constraint, tools = _structured(router, body, chat=chat, limits=limits)
    sampling = dataclasses.replace(req.sampling, constraint=constraint)
    budget = router.budget(sampling)        # priced before tokenisation, charged while it runs
    if chat:
        # priced in the thread, before the template is applied (Renderer.chat_ids): once
        msgs, tools_arg = prepare_tools(req.messages, tools, template_takes_tools(router.renderer.tok))
        ids = await anyio.to_thread.run_sync(functools.partial(router.renderer.chat_ids, msgs, budget, tools_arg))
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
    # one request id; choice i > 0 of n runs as <id>.<i> (its own plan, transfer and logs)
    gens = [router.stream_prompt(tenant, ids, policy=req.policy, sampling=choice_sampling(sampling, i),
                                 deadline_s=req.deadline_s, request_id=rid if i == 0 else f"{rid}.{i}")
            for i in range(n)]
    try:
        primed = await asyncio.gather(*(_primed(g) for g in gens))
    except BaseException:
        for g in gens:
            await g.aclose()
        raise
    streams = [_chain(first, g) for first, g in primed]
    cid = ("chatcmpl-" if chat else "cmpl-") + rid
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    lp = _Logprobs(router.renderer.tok, chat)
    extra = {"structured": {"constraint": constraint.kind if constraint is not None else None,
                            "tool_choice": tools.choice if tools is not None else None, "choices": n}}
    if not stream:
        got = await asyncio.gather(*(_drain(s) for s in streams))
        out, fins = [], []
        for i, (evs, fin) in enumerate(got):
            sent = "".join(e.text for e in evs)
            text = sent + _tail(sent, fin)
            fins.append(fin)
            if chat:
                content, calls, finish = Answer(tools).whole(text, fin.summary.finish_reason)
                msg = {"role": "assistant", "content": content}
                if calls:
                    msg["tool_calls"] = calls
                out.append({"index": i, "message": msg, "logprobs": lp.of(evs), "finish_reason": finish})
            else:
                out.append({"index": i, "text": text, "finish_reason": fin.summary.finish_reason,
                            "logprobs": lp.of(evs)})
        return JSONResponse({"id": cid, "object": obj, "created": created, "model": model, "choices": out,
                             "usage": _total_usage(fins), "kvnotes": _kvnotes(fins[0], explain, extra)})

    def chunk(i: int, delta: dict | str | None, finish, evs=()) -> dict:
        if chat:
            d = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            c = {"index": i, "delta": d, "logprobs": lp.of(list(evs)), "finish_reason": finish}
        else:
            c = {"index": i, "text": delta or "", "logprobs": lp.of(list(evs)), "finish_reason": finish}
        return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model, "choices": [c]}

    async def events():
        answers = [Answer(tools if chat else None) for _ in range(n)]
        sent, fins = [""] * n, []
        try:
            if chat:
                for i in range(n):
                    yield _sse(chunk(i, {"role": "assistant", "content": ""}, None))
            async for i, ev in merged(streams):
                if isinstance(ev, TokenEvent):
                    if ev.text or ev.logprob is not None:
                        sent[i] += ev.text
                        d = answers[i].push(ev.text)
                        if d or (ev.logprob is not None and answers[i].stream is None):
                            yield _sse(chunk(i, d, None, [ev]))
                    continue
                fins.append(ev)
                rest, calls, finish = answers[i].finish(_tail(sent[i], ev), ev.summary.finish_reason)
                for d in call_deltas(calls):
                    yield _sse(chunk(i, d, None))
                end = chunk(i, rest or None, finish)
                if len(fins) == n:
                    if include_usage:
                        end["usage"] = _total_usage(fins)
                    end["kvnotes"] = _kvnotes(fins[0], explain, extra)
                yield _sse(end)
        except Exception as exc:  # mid-stream failure: reported in-band, logged, the stream ends
            yield _sse(stream_error_json(exc, rid))
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def notes_complete(router: Router, limits: RequestLimits, body: dict, tenant: str, rid: str) -> Response:
    req = native_request(body, limits, model=router.served_model, vocab=len(router.renderer.tok))
    stream, explain = req.stream, req.explain
    constraint, _ = _structured(router, body, chat=False, limits=limits)
    sampling = dataclasses.replace(req.sampling, constraint=constraint)
    first, gen = await _primed(router.stream_native(tenant, req.segments, policy=req.policy, session=req.session,
                                                    sampling=sampling, edit=req.edit, deadline_s=req.deadline_s,
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
