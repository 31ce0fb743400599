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

import dataclasses
import functools
import json
import logging
import time

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.control.context import RequestContext
from cluster.control.errors import RequestError
from cluster.http.errors import internal_error_json
from cluster.control.routing import WorkerLost
from cluster.control.limits import RequestLimits
from cluster.control.lifecycle import Finished
from cluster.control.router import Router
from cluster.control.limits import check_name, check_text
from cluster.http.choices import Answer, call_deltas, merged, prompt_details
from cluster.http.completion import Prepared, collect as _collect, drain, prepare, start, structured
from cluster.http.completion import tail as _tail
from cluster.http.logprobs import Logprobs
from cluster.http.completion import primed as _primed
from cluster.http.validate import native_request
from kvruntime.messages.decode import TokenEvent

log = logging.getLogger(__name__)


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.summary.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.summary.completion_tokens,
            "prompt_tokens_details": prompt_details(fin)}


def _kvnotes(fin: Finished, explain: bool, extra: dict | None = None) -> dict:
    out = {"plan": fin.plan.kind.value, "ttft_s": round(fin.ttft_s, 6), "fallbacks": list(fin.fallbacks)}
    if explain:
        out["explain"] = {**fin.plan.explain(), "transport": fin.transport,
                          "stages": {k: round(v, 6) for k, v in fin.stages}, **(extra or {})}
        if fin.clock is not None:     # control-path laps (cluster.control.lifecycle.StageClock)
            out["explain"]["control"] = fin.clock.as_json()
    return out


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


def _total_usage(fins: list[Finished], prompts: int = 1) -> dict:
    """Usage of several choices (``fins`` in choice order): each prompt once (the ``n`` choices of
    a prompt share it), every choice's completion tokens."""
    firsts = fins[::max(1, len(fins) // prompts)]
    u = _usage(fins[0])
    u["prompt_tokens"] = sum(f.prompt_tokens for f in firsts)
    u["prompt_tokens_details"] = prompt_details(firsts)
    u["completion_tokens"] = sum(f.summary.completion_tokens for f in fins)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


class _View:
    """How one prepared request's choices look as OpenAI objects (chat or text completion)."""

    def __init__(self, router: Router, prep: Prepared, rid: str, explain: bool):
        self.prep, self.chat, self.explain = prep, prep.chat, explain
        self.model = router.served_model
        self.cid = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.created = int(time.time())
        self.lp = Logprobs(router.renderer.tok, self.chat)

    def _prompt(self, k: int, scored) -> tuple | None:
        """Choice ``k``'s prompt rows for its log-probs (echo + logprobs; ``scored``: the prompt's
        log-probs, from the first event or the end), else None."""
        return (self.prep.prompt_of(k), scored) if self.prep.scores_prompt else None

    def choice(self, k: int, evs: list[TokenEvent], fin: Finished) -> dict:
        sent = "".join(e.text for e in evs)
        text = sent + _tail(sent, fin)
        if not self.chat:
            return {"index": k, "text": self.prep.echo(k) + text, "finish_reason": fin.summary.finish_reason,
                    "logprobs": self.lp.of(evs, prompt=self._prompt(k, fin.prompt_logprobs))}
        content, calls, finish = Answer(self.prep.tools).whole(text, fin.summary.finish_reason)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return {"index": k, "message": msg, "logprobs": self.lp.of(evs), "finish_reason": finish}

    def whole(self, got: list[tuple[list[TokenEvent], Finished]]) -> dict:
        fins = [fin for _, fin in got]
        return {"id": self.cid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self.choice(k, evs, fin) for k, (evs, fin) in enumerate(got)],
                "usage": _total_usage(fins, len(self.prep.prompts)),
                "kvnotes": _kvnotes(fins[0], self.explain, self.prep.explain_extra())}

    def chunk(self, k: int, delta: dict | str | None, finish, evs=(), *, offset: int = 0, prompt=None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            c = {"index": k, "delta": d, "logprobs": self.lp.of(list(evs)), "finish_reason": finish}
        else:
            c = {"index": k, "text": delta or "", "logprobs": self.lp.of(list(evs), offset=offset, prompt=prompt),
                 "finish_reason": finish}
        return {"id": self.cid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [c]}

    def opening(self):
        """The chunks before any token: the role (chat), the echoed prompt (completions with echo;
        with the prompt's log-probs: at the choice's first event, :meth:`echo`)."""
        for k in range(self.prep.choices):
            if self.chat:
                yield self.chunk(k, {"role": "assistant", "content": ""}, None)
            elif self.prep.echo(k) and not self.prep.scores_prompt:
                yield self.chunk(k, self.prep.echo(k), None)

    def echo(self, k: int, first) -> list[dict]:
        """Choice ``k``'s echoed prompt with its log-probs, once its first event (``first``: a
        TokenEvent or its end, both carrying them) is here."""
        if not self.prep.scores_prompt:
            return []
        return [self.chunk(k, self.prep.echo(k), None, prompt=self._prompt(k, first.prompt_logprobs))]

    def end(self, k: int, answer: Answer, sent: str, fin: Finished) -> list[dict]:
        """The last chunks of choice ``k``: its tool calls, then what is left and the finish reason."""
        rest, calls, finish = answer.finish(_tail(sent, fin), fin.summary.finish_reason)
        return [self.chunk(k, d, None) for d in call_deltas(calls)] + [self.chunk(k, rest or None, finish)]


async def _events(view: _View, streams, rid: str):
    """The SSE stream of every choice, interleaved as they come; usage (with
    ``stream_options.include_usage``) and ``kvnotes`` on the last choice's last chunk."""
    prep = view.prep
    answers = [Answer(prep.tools if view.chat else None) for _ in streams]
    sent, fins, opened = [""] * len(streams), {}, set()
    try:
        for c in view.opening():
            yield _sse(c)
        async for k, ev in merged(streams):
            if k not in opened:
                opened.add(k)
                for c in view.echo(k, ev):
                    yield _sse(c)
            if isinstance(ev, TokenEvent):
                if ev.text or ev.logprob is not None:
                    at = len(prep.echo(k)) + len(sent[k])
                    sent[k] += ev.text
                    d = answers[k].push(ev.text)
                    if d or (ev.logprob is not None and answers[k].stream is None):
                        yield _sse(view.chunk(k, d, None, [ev], offset=at))
                continue
            fins[k] = ev
            chunks = view.end(k, answers[k], sent[k], ev)
            if len(fins) == len(streams):
                ordered = [fins[i] for i in range(len(streams))]
                if prep.req.include_usage:
                    chunks[-1]["usage"] = _total_usage(ordered, len(prep.prompts))
                chunks[-1]["kvnotes"] = _kvnotes(ordered[0], view.explain, prep.explain_extra())
            for c in chunks:
                yield _sse(c)
    except Exception as exc:  # mid-stream failure: reported in-band, logged, the stream ends
        yield _sse(stream_error_json(exc, rid))
    yield b"data: [DONE]\n\n"


async def openai_complete(router: Router, limits: RequestLimits, body: dict, ctx: RequestContext, *,
                          chat: bool) -> Response:
    """``/v1/completions`` and ``/v1/chat/completions``: prepared, started and answered in stages
    (``cluster.http.completion``)."""
    rid = ctx.request_id
    prep = await prepare(router, limits, body, chat=chat)
    streams = await start(router, ctx, prep)
    view = _View(router, prep, rid, prep.req.explain)
    if not prep.req.stream:
        return JSONResponse(view.whole(await drain(streams)))
    return StreamingResponse(_events(view, streams, rid), media_type="text/event-stream")


async def notes_complete(router: Router, limits: RequestLimits, body: dict, ctx: RequestContext) -> Response:
    req = native_request(body, limits, model=router.served_model, vocab=len(router.renderer.tok))
    stream, explain = req.stream, req.explain
    constraint, _ = await anyio.to_thread.run_sync(functools.partial(structured, router, body, chat=False))
    sampling = dataclasses.replace(req.sampling, constraint=constraint)
    rid = ctx.request_id
    first, gen = await _primed(router.stream_native(ctx.with_body(policy=req.policy, deadline_s=req.deadline_s),
                                                    req.segments, session=req.session, sampling=sampling,
                                                    edit=req.edit))
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
