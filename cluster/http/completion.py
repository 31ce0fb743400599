"""The OpenAI generation pipeline in stages, shared by ``/v1/completions``,
``/v1/chat/completions`` (``cluster.http.api``) and ``/v1/responses`` (``cluster.http.responses``):

1. :func:`prepare`: the body validated once (``cluster.http.validate``), its structured-output
   constraint and tools checked in a worker thread (schema checks are cached,
   ``cluster.http.structured``), the prompt(s) tokenised in a worker thread, priced against the
   window first (``cluster.control.pricing``) -> a frozen :class:`Prepared`.
2. :func:`start`: one router stream per prompt and choice (``index`` = prompt * n + choice, as
   vLLM numbers a batch), each primed with its first event so that a planning error is a 4xx
   before any byte is sent; choice ``k`` > 0 runs as ``<request id>.<k>``.
3. :func:`drain`: a whole answer's events (the non-streamed path).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass

import anyio

from cluster.control.context import RequestContext
from cluster.control.errors import RequestError
from cluster.control.lifecycle import Finished
from cluster.control.limits import RequestLimits
from cluster.control.router import Router
from cluster.control.tools import Tools, constraint as tool_constraint, parse_tools, prepare as prepare_tools
from cluster.control.tools import template_takes_tools
from cluster.http.choices import choice_sampling
from cluster.http.structured import check_schema, response_format
from cluster.http.validate import OpenAIRequest, openai_request
from kvruntime.messages.decode import Constraint, SamplingParams, TokenEvent


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenised OpenAI request, ready to run."""
    req: OpenAIRequest
    chat: bool
    constraint: Constraint | None
    tools: Tools | None
    sampling: SamplingParams
    prompts: tuple[tuple[int, ...], ...]     # token ids of each prompt (chat: one)
    echoes: tuple[str, ...] = ()             # completions with echo: each prompt's text
    messages: tuple = ()                     # chat: (index, role, first token, end) of each message's content

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.req.n

    def echo(self, k: int) -> str:
        """The text echoed before choice ``k``'s completion ("" without ``echo``)."""
        return self.echoes[k // self.req.n] if self.echoes else ""

    def prompt_of(self, k: int) -> tuple[int, ...]:
        """Choice ``k``'s prompt token ids."""
        return self.prompts[k // self.req.n]

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``logprobs``: each choice's prompt log-probs come back (every prompt token
        computed: ``cluster.control.prompt_logprobs``)."""
        return self.sampling.prompt_logprobs is not None

    def explain_extra(self) -> dict:
        return {"structured": {"constraint": self.constraint.kind if self.constraint is not None else None,
                               "tool_choice": self.tools.choice if self.tools is not None else None,
                               "choices": self.req.n}}


def structured(router: Router, body: dict, *, chat: bool) -> tuple[Constraint | None, Tools | None]:
    """(constraint, tools) of a request; counts refused schemas and constrained requests.
    Blocking (jsonschema, xgrammar): run in a worker thread."""
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


async def _prompt_ids(router: Router, sampling: SamplingParams, prompt: str | list[int]) -> list[int]:
    """One completions prompt's token ids (a string tokenised in a worker thread, priced first),
    with the model's BOS first where it wants one."""
    if isinstance(prompt, str):
        budget = router.budget(sampling)        # priced before tokenisation, charged while it runs
        budget.price_chars(len(prompt))
        ids = await anyio.to_thread.run_sync(budget.encode, router.renderer.encode, prompt)
    else:
        router.budget(sampling)                 # max_tokens checked against the server's limit
        ids = list(prompt)
    bos = router.renderer.bos_id
    if router.renderer.spec.prepend_bos and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


def _checked_ids(ids: list[int], vocab: int, param: str) -> tuple[int, ...]:
    if not ids:
        raise RequestError(400, f"{param} is empty after tokenization", param=param)
    if any(t >= vocab for t in ids):
        raise RequestError(400, f"{param} token ids must be below the vocabulary size {vocab}", param=param)
    return tuple(ids)


async def prepare(router: Router, limits: RequestLimits, body: dict, *, chat: bool) -> Prepared:
    """Stage 1: every check, the constraint, the token ids."""
    vocab = len(router.renderer.tok)
    req = openai_request(body, limits, model=router.served_model, vocab=vocab, chat=chat)
    constraint, tools = await anyio.to_thread.run_sync(functools.partial(structured, router, body, chat=chat))
    # echo + logprobs: the prompt's own log-probs too (as vLLM), each prompt computed in full
    scored = req.sampling.logprobs if req.echo and not chat else None
    sampling = dataclasses.replace(req.sampling, constraint=constraint, prompt_logprobs=scored)
    if chat:
        router.renderer.check_call_ids(req.messages)
        budget = router.budget(sampling)        # priced in the thread, before the template is applied
        msgs, tools_arg = prepare_tools(req.messages, tools, template_takes_tools(router.renderer.tok))
        spans: list = []                        # where each message's content lies (explain: the first divergence)
        ids = await anyio.to_thread.run_sync(functools.partial(router.renderer.chat_ids, msgs, budget, tools_arg,
                                                               spans))
        return Prepared(req, chat, constraint, tools, sampling, (_checked_ids(ids, vocab, "prompt"),),
                        messages=tuple(spans))
    prompts = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        prompts.append(_checked_ids(await _prompt_ids(router, sampling, p), vocab, param))
    echoes = ()
    if req.echo:
        decode = router.renderer.tok.decode
        echoes = tuple([p if isinstance(p, str) else await anyio.to_thread.run_sync(decode, p) for p in req.prompts])
    return Prepared(req, chat, constraint, None, sampling, tuple(prompts), echoes)


async def primed(gen):
    """Pull the first event before answering, so validation errors raised while planning
    become a 4xx response instead of a broken stream."""
    first = await gen.__anext__()
    return first, gen


async def _chain(first, gen):
    yield first
    async for ev in gen:
        yield ev


async def start(router: Router, ctx: RequestContext, prep: Prepared) -> list:
    """Stage 2: the streams of every choice, each primed (its first event pulled); each choice its
    own context (``<id>.<i>``, its own leases; the request's clock, outcome and ticket)."""
    req, n, rid = prep.req, prep.req.n, ctx.request_id
    ctx = ctx.with_body(policy=req.policy, deadline_s=req.deadline_s)
    gens = [router.stream_prompt(ctx.choice(rid if p * n + j == 0 else f"{rid}.{p * n + j}"), list(ids),
                                 sampling=choice_sampling(prep.sampling, j), messages=prep.messages, edit=req.edit)
            for p, ids in enumerate(prep.prompts) for j in range(n)]
    try:
        firsts = await asyncio.gather(*(primed(g) for g in gens))
    except BaseException:
        for g in gens:
            await g.aclose()
        raise
    return [_chain(first, g) for first, g in firsts]


async def collect(first, gen) -> tuple[list[TokenEvent], Finished]:
    evs, ev = [], first
    while not isinstance(ev, Finished):
        evs.append(ev)
        ev = await gen.__anext__()
    return evs, ev


async def _drain_one(stream) -> tuple[list[TokenEvent], Finished]:
    return await collect(await stream.__anext__(), stream)


async def drain(streams) -> list[tuple[list[TokenEvent], Finished]]:
    """Stage 3 (not streamed): every choice's events and its end."""
    return list(await asyncio.gather(*(_drain_one(s) for s in streams)))


def tail(sent: str, fin: Finished) -> str:
    """Text the decoder held back until the end (a partial stop string or character before EOS)."""
    return fin.summary.text[len(sent):] if fin.summary.text.startswith(sent) else ""
