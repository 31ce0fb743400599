"""The Responses API's event stream (``stream: true`` on ``/v1/responses``), in the order OpenAI
and vLLM send it, each event an SSE ``event:`` + ``data:`` pair with a ``sequence_number``:

``response.created``, ``response.in_progress``; for text, ``response.output_item.added`` (the
message), ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for each tool call, ``response.output_item.added`` (the ``function_call``),
``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
``response.output_item.done``; last ``response.completed`` with the whole response (its
``status`` ``incomplete`` when ``max_output_tokens`` cut it, as vLLM). A failure after the stream
started is an ``error`` event. Text that may be a tool call is held back as on the chat path
(``cluster.control.tools.CallStream``), so the deltas add up to the stored answer.
"""
from __future__ import annotations

import json

from cluster.control.lifecycle import Finished
from cluster.control.router import Router
from cluster.http import api
from cluster.http.choices import Answer
from cluster.http.completion import tail
from cluster.http.responses_shape import Shape, keep
from kvruntime.messages.decode import TokenEvent


class _Events:
    """Numbered SSE events of one response."""

    def __init__(self, shape: Shape):
        self.shape, self.seq = shape, 0
        self.text, self.open = "", False

    def ev(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def text_delta(self, delta: str) -> list[bytes]:
        """The message's events for ``delta`` (the message and its part opened on the first)."""
        out, mid = [], self.shape.msg_id
        if not self.open:
            self.open = True
            out += [self.ev("response.output_item.added", output_index=0, item=self.shape.message("", "in_progress")),
                    self.ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                            part=self.shape.part(""))]
        self.text += delta
        return out + [self.ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                              delta=delta, logprobs=[])]

    def text_done(self) -> list[bytes]:
        if not self.open:
            return []
        mid, text = self.shape.msg_id, self.text
        return [self.ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text,
                        logprobs=[]),
                self.ev("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                        part=self.shape.part(text)),
                self.ev("response.output_item.done", output_index=0, item=self.shape.message(text))]

    def call(self, index: int, c: dict) -> list[bytes]:
        item = self.shape.call(c)
        return [self.ev("response.output_item.added", output_index=index, item=self.shape.call(c, "in_progress")),
                self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
                self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
                self.ev("response.output_item.done", output_index=index, item=item)]


async def events(router: Router, tenant: str, shape: Shape, prior: list[dict], stream):
    """The whole event stream of one response; stored (with ``store``) before ``response.completed``."""
    out, prep = _Events(shape), shape.prep
    answer, sent = Answer(prep.tools), ""
    try:
        yield out.ev("response.created", response=shape.obj([], None))
        yield out.ev("response.in_progress", response=shape.obj([], None))
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                sent += ev.text
                d = answer.push(ev.text) if ev.text else ""
                for b in out.text_delta(d) if d else ():
                    yield b
                continue
            fin: Finished = ev
            rest, calls, _ = answer.finish(tail(sent, fin), fin.summary.finish_reason)
            for b in [*(out.text_delta(rest) if rest else ()), *out.text_done()]:
                yield b
            first = 1 if out.open else 0
            for k, c in enumerate(calls):
                for b in out.call(first + k, c):
                    yield b
            content = out.text or None
            obj = shape.obj(shape.output(content, calls), fin, prep.req.explain)
            await keep(router, tenant, shape, obj, shape.conversation(prior, content, calls))
            yield out.ev("response.completed", response=obj)
    except Exception as exc:  # mid-stream failure: reported in-band, logged, the stream ends
        err = api.stream_error_json(exc, shape.rid)["error"]
        yield out.ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
