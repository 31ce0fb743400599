"""The ``response`` object of a ``/v1/responses`` request (``cluster.http.responses``), its
output items (a ``message`` with ``output_text``, ``function_call`` items), its usage (the chat
path's, renamed: ``input_tokens_details.cached_tokens`` is the reused prompt), and storing it with
its conversation in the state store."""
from __future__ import annotations

import json
import time

import anyio

from cluster.control.lifecycle import Finished
from cluster.control.router import Router
from cluster.http import api
from cluster.http.completion import Prepared
from cluster.http.responses_body import ResponsesRequest


def usage(fin: Finished) -> dict:
    """The Responses usage shape of the chat path's usage (``cached_tokens``: prompt tokens whose
    KV was reused)."""
    u = api._usage(fin)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": dict(u["prompt_tokens_details"]),
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class Shape:
    """The ``response`` object of one request, as it is built up."""

    def __init__(self, router: Router, spec: ResponsesRequest, prep: Prepared, rid: str):
        self.spec, self.prep, self.rid = spec, prep, rid
        self.id, self.msg_id = "resp_" + rid, "msg_" + rid
        self.model, self.created = router.served_model, int(time.time())

    def message(self, text: str, status: str = "completed") -> dict:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(text)] if status == "completed" else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call(c: dict, status: str = "completed") -> dict:
        """A chat tool call as a ``function_call`` output item."""
        return {"id": "fc_" + c["id"].removeprefix("call_"), "type": "function_call", "call_id": c["id"],
                "name": c["function"]["name"], "arguments": c["function"]["arguments"] if status == "completed" else "",
                "status": status}

    def output(self, content: str | None, calls: list[dict]) -> list[dict]:
        return ([self.message(content)] if content else []) + [self.call(c) for c in calls]

    def obj(self, output: list[dict], fin: Finished | None, explain: bool = False) -> dict:
        """The response object (``fin`` None: still in progress)."""
        s = self.prep.sampling
        status = "in_progress" if fin is None else "incomplete" if fin.summary.finish_reason == "length" else "completed"
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "background": False, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": self.spec.instructions, "max_output_tokens": self.spec.max_output_tokens,
               "model": self.model, "output": output, "previous_response_id": self.spec.previous_response_id,
               "reasoning": None, "service_tier": "default", "store": self.spec.store,
               "temperature": s.temperature, "top_p": s.top_p, "truncation": "disabled",
               "usage": usage(fin) if fin is not None else None, **self.spec.echo}
        if fin is not None:
            out["kvnotes"] = api._kvnotes(fin, explain, self.prep.explain_extra())
        return out

    def conversation(self, prior: list[dict], content: str | None, calls: list[dict]) -> list[dict]:
        """The chat messages a later ``previous_response_id`` continues from."""
        turn = {"role": "assistant", "content": content or ""}
        if calls:
            turn["tool_calls"] = calls
        return [*prior, *self.spec.new_messages, turn]


async def keep(router: Router, tenant: str, shape: Shape, obj: dict, conversation: list[dict]) -> None:
    """Store the answer and its conversation when the request asked to (``store``)."""
    if shape.spec.store:
        data = json.dumps({"response": obj, "messages": conversation})
        await anyio.to_thread.run_sync(router.state.put_response, tenant, shape.id, data, time.time())
