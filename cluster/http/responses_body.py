"""A ``POST /v1/responses`` body, validated and translated onto the chat-completions path: the
Responses ``input`` (a string, or items: messages, ``function_call``, ``function_call_output``),
``instructions``, ``tools`` and ``tool_choice``, ``text.format`` and the sampling fields become
one chat body, which ``cluster.http.completion`` then checks, tokenises and runs like any chat
request (so the prompt index applies to it). What a Responses field accepts is listed in
docs/api.md; anything else is a 400 naming the field.

``previous_response_id``: the stored conversation of that response (its input and output as
chat messages, never its ``instructions``, as OpenAI does) comes before this request's ``input``.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits

_PASSED = ("model", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "user",
           "metadata", "parallel_tool_calls", "kv_policy", "explain", "deadline_s", "edit_strategy")
_CHECKED = {"input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "stream", "store",
            "previous_response_id", "include", "truncation", "reasoning", "service_tier", "background",
            "prompt_cache_key", "stream_options", "max_tool_calls", "top_logprobs"}
_TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param)


def _defaults_only(body: dict) -> None:
    """Fields this server takes only at their default (they would change nothing, or ask for what
    it does not do): anything else is a 400 naming the field."""
    allowed = {"include": (None, []), "truncation": (None, "disabled"), "reasoning": (None, {}),
               "service_tier": (None, "auto", "default"), "background": (None, False), "max_tool_calls": (None,),
               "top_logprobs": (None, 0)}
    for k, ok in allowed.items():
        if k in body and body[k] not in ok:
            raise _bad(f"{k} {str(body[k])[:80]!r} is not supported here (accepted: "
                       f"{', '.join(repr(v) for v in ok if v is not None)})", k)
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_obfuscation"}):
        raise _bad("stream_options may only hold include_obfuscation", "stream_options")
    pck = body.get("prompt_cache_key")
    if pck is not None and (not isinstance(pck, str) or len(pck) > 256):
        raise _bad("prompt_cache_key must be a string of at most 256 characters", "prompt_cache_key")


def _text(parts, param: str, limits: RequestLimits) -> str:
    """A content value: a string, or text parts (``input_text`` / ``output_text``) joined."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or len(parts) > limits.max_segments:
        raise _bad(f"{param} must be a string or a list of text parts", param)
    out = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(p.get("text"), str):
            shown = kind if isinstance(kind, str) else type(p).__name__
            raise _bad(f"{param}[{j}] must be a text part {{\"type\": \"input_text\", \"text\": ...}} (got "
                       f"{shown[:40]!r}: images, files and audio are not supported)", f"{param}[{j}]")
        out.append(p["text"])
    return "".join(out)


def _call(item: dict, i: int) -> dict:
    """A ``function_call`` item as a chat tool call."""
    for k in ("call_id", "name", "arguments"):
        if not isinstance(item.get(k), str) or not item[k]:
            raise _bad(f"input[{i}].{k} must be a non-empty string", f"input[{i}].{k}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _message(item: dict, i: int, limits: RequestLimits) -> dict:
    role = item.get("role")
    if role not in ROLES or set(item) - {"type", "role", "content", "id", "status"}:
        raise _bad(f"input[{i}] must be a message {{\"role\": user|system|developer|assistant, \"content\"}}, a "
                   "function_call or a function_call_output", f"input[{i}]")
    return {"role": role, "content": _text(item.get("content"), f"input[{i}].content", limits)}


def input_messages(value, limits: RequestLimits) -> list[dict]:
    """``input`` as chat messages: consecutive ``function_call`` items join the assistant turn
    before them (or start one), ``function_call_output`` items become ``tool`` messages."""
    if isinstance(value, str):
        if not value:
            raise _bad("input must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or len(value) > limits.max_segments:
        raise _bad(f"input must be a string or a non-empty list of at most {limits.max_segments} items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            call = _call(item, i)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise _bad(f"input[{i}].call_id must name the function_call it answers", f"input[{i}].call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"input[{i}].output", limits)})
        elif kind == "message":
            out.append(_message(item, i, limits))
        else:
            raise _bad(f"input[{i}] of type {str(kind)[:40]!r} is not supported (message, function_call, "
                       "function_call_output)", f"input[{i}]")
    return out


def _tools(tools) -> list[dict] | None:
    """Responses function tools ``{"type": "function", "name", ...}`` as chat tools."""
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of functions", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            shown = t.get("type") if isinstance(t, dict) else t
            raise _bad(f"tools[{i}] of type {str(shown)[:40]!r} is not supported: only function tools", f"tools[{i}]")
        extra = set(t) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise _bad(f"tools[{i}] has unknown field(s) {', '.join(sorted(extra))[:200]}", f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def _format(text) -> dict | None:
    """``text.format`` as a chat ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None,):
        raise _bad("text may only hold format ({\"type\": \"text\" | \"json_object\" | \"json_schema\", ...})", "text")
    f = text.get("format")
    if f is None or f == {"type": "text"}:
        return None
    if not isinstance(f, dict) or f.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type must be text, json_object or json_schema", "text.format")
    if f["type"] != "json_schema":
        return {"type": f["type"], **{k: v for k, v in f.items() if k != "type"}}
    extra = set(f) - {"type", "name", "schema", "description", "strict"}
    if extra:
        raise _bad(f"text.format has unknown field(s) {', '.join(sorted(extra))[:200]}", "text.format")
    return {"type": "json_schema", "json_schema": {k: f[k] for k in ("name", "schema", "description", "strict")
                                                   if f.get(k) is not None}}


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses body: the chat body it runs as, and what the answer echoes back."""
    chat: dict                       # the chat-completions body (messages without the stored conversation)
    new_messages: tuple              # this request's input as chat messages (stored with the answer)
    instructions: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    max_output_tokens: int
    echo: dict                       # fields the Response object repeats (tools, tool_choice, text, ...)


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false", key)
    return v


def responses_request(body: dict, limits: RequestLimits, *, default_max_tokens: int) -> ResponsesRequest:
    """Every check of a Responses body that is not the chat path's own, and the chat body."""
    unknown = set(body) - _CHECKED - set(_PASSED)
    if unknown:
        raise _bad(f"unsupported field(s): {', '.join(sorted(unknown))[:300]}", sorted(unknown)[0][:64])
    _defaults_only(body)
    ins = body.get("instructions")
    if ins is not None and not isinstance(ins, str):
        raise _bad("instructions must be a string", "instructions")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not 0 < len(prev) <= 200):
        raise _bad("previous_response_id must be the id of a stored response", "previous_response_id")
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or not 1 <= mot <= limits.max_tokens):
        raise _bad(f"max_output_tokens must be an integer between 1 and {limits.max_tokens}", "max_output_tokens")
    msgs = input_messages(body.get("input"), limits)
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["max_tokens"] = mot or default_max_tokens
    for k, v in (("tools", _tools(body.get("tools"))), ("tool_choice", _tool_choice(body.get("tool_choice"))),
                 ("response_format", _format(body.get("text")))):
        if v is not None:
            chat[k] = v
    echo = {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "user": body.get("user"), "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False}
    return ResponsesRequest(chat, tuple(msgs), ins or None, _flag(body, "stream", False), _flag(body, "store", True),
                            prev, chat["max_tokens"], echo)
