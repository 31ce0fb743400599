"""The OpenAI answer's choices: ``n`` independent samples run side by side (seeds derived per
choice), each one's text turned into ``content`` or ``tool_calls`` (``cluster.control.tools``),
and their SSE streams merged. Used by ``cluster.http.api``."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib

from cluster.control import tools as tool_calls
from cluster.control.tools import CallStream, Tools
from kvruntime.messages.decode import SEED_MAX, SamplingParams


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s parameters: choice 0 keeps the request's seed (so ``n=1`` is unchanged), the
    others a seed derived from it and ``i`` (a seeded ``n`` request is reproducible)."""
    if i == 0 or sampling.seed is None:
        return sampling
    d = hashlib.sha256(f"{sampling.seed}:{i}".encode()).digest()
    return dataclasses.replace(sampling, seed=int.from_bytes(d[:8], "big") & SEED_MAX)


class Answer:
    """One choice's text as the client sees it."""

    def __init__(self, tools: Tools | None):
        self.tools = tools if tools is not None and tools.active else None
        forced = self.tools is not None and self.tools.choice in ("required", "function")
        self.stream = CallStream(self.tools, hold_all=forced) if self.tools is not None else None

    def push(self, text: str) -> str:
        """Content to stream now for ``text`` (held back while it may be a tool call)."""
        return self.stream.push(text) if self.stream is not None else text

    def finish(self, tail: str, finish_reason: str) -> tuple[str, list[dict], str]:
        """(content not yet streamed, OpenAI tool_calls, finish reason) at the end of a stream."""
        if self.stream is None:
            return tail, [], finish_reason
        self.stream.push(tail)
        rest, calls = self.stream.finish()
        if calls and finish_reason == "stop":
            return rest, tool_calls.openai_calls(calls), "tool_calls"
        return self.stream.text[self.stream.sent:], [], finish_reason

    def whole(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """(content, OpenAI tool_calls, finish reason) of a whole answer."""
        if self.tools is None:
            return text, [], finish_reason
        content, calls = tool_calls.parse_calls(text, self.tools)
        if calls and finish_reason == "stop":
            return content, tool_calls.openai_calls(calls), "tool_calls"
        return text, [], finish_reason


def call_deltas(calls: list[dict]) -> list[dict]:
    """Streamed ``tool_calls`` deltas: per call, its id and name, then its arguments."""
    out = []
    for k, c in enumerate(calls):
        out.append({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


async def merged(gens):
    """(choice index, event) from several async generators as they come; all closed at the end."""
    if len(gens) == 1:
        async for ev in gens[0]:
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for ev in g:
                await q.put((i, ev))
        except BaseException as exc:    # handed to the reader, which re-raises it
            await q.put((i, exc))
        finally:
            await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    left = len(gens)
    try:
        while left:
            i, ev = await q.get()
            if ev is done:
                left -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()


def prompt_details(fins) -> dict[str, int]:
    """``usage.prompt_tokens_details`` of one prompt's answer or several prompts' (``fins``: a
    ``Finished`` each): ``cached_tokens`` (every prompt token nobody computed for the request) and
    beside it the same tokens by kind of reuse: ``exact_tokens``, ``composed_tokens``,
    ``edited_tokens`` (``cluster.control.reuse_kinds``), so a client sees whether its answer rests
    on approximate reuse."""
    from cluster.control.reuse_kinds import REUSE_KINDS, reuse_split, usage_details
    fins = fins if isinstance(fins, (list, tuple)) else [fins]
    split = dict.fromkeys(REUSE_KINDS, 0)
    for fin in fins:
        for k, n in reuse_split(fin.plan, dict(fin.sources)).items():
            split[k] += n
    return usage_details(sum(f.cached_tokens for f in fins), split)
