"""Tool calls (OpenAI ``tools`` / ``tool_choice``) for chat completions: validation, rendering into
the prompt, the constraint a forced call decodes under, and parsing the answer back into
``tool_calls``.

Rendering. A chat template that handles tools (its source names ``tools``: Qwen / Hermes, Llama
3.x, Mistral...) gets them through ``apply_chat_template(tools=...)``, its own format. A template
without tool support (the shipped SmolLM2 and Gemma-3 270M) gets them as a system-prompt block,
:func:`system_block`, put first in the first system message, so the tools are a stable prefix:
the prompt index (``cluster.control.router``, 256-token blocks) finds that prefix's KV again on
every turn and every conversation that sends the same tools. Earlier ``assistant`` turns with
``tool_calls`` are rendered in the format that block asks for (``{"name", "arguments"}``), and
``tool`` messages as user messages naming the call.

Forcing. ``tool_choice: "required"`` or a named function decodes under a JSON-schema
constraint: ``{"name": <one of the tools> (const), "arguments": <its parameters schema>}``
(``anyOf`` over the tools for ``required``), whatever the template's own format; compiled, like
every schema, in xgrammar's strict mode (``cluster.http.structured``: no argument the
parameters do not name unless they allow it). ``required`` with ``parallel_tool_calls`` true
(the default) is a JSON array of one or more such calls, as vLLM builds it; false, or a named
function, exactly one call.

``parallel_tool_calls: false`` also keeps only the first call an ``auto`` answer holds.

Parsing (``auto``): the answer is searched for the families' formats, in this order:
Hermes / Qwen ``<tool_call>{...}</tool_call>``, Mistral ``[TOOL_CALLS] [{...}, ...]``, Llama-3.x
``<|python_tag|>`` or a bare JSON object ``{"name", "parameters" | "arguments"}`` (also what the
system-prompt block asks for). Only calls naming a declared tool count; anything else stays text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from cluster.control.errors import RequestError
from kvruntime.messages.decode import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128

SYSTEM_HEAD = ("You can call the functions below. To call one, answer with only a JSON object "
               "{\"name\": <function name>, \"arguments\": <object of its arguments>} and nothing else; "
               "otherwise answer normally.\nFunctions:\n")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]     # {"name", "description", "parameters"} as sent (parameters defaulted)
    choice: str                     # "none" | "auto" | "required" | "function" (a named one)
    forced: str | None = None       # the named function
    parallel: bool = True           # parallel_tool_calls: several calls per answer (False: at most one)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["name"] for f in self.functions)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def metric_kind(self) -> str:
        return {"auto": "tool_auto", "required": "tool_required", "function": "tool_named"}.get(self.choice, "")


def parallel_calls(body: dict) -> bool:
    """``parallel_tool_calls`` (default true)."""
    v = body.get("parallel_tool_calls")
    if v is None:
        return True
    if not isinstance(v, bool):
        raise RequestError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return v


def parse_tools(body: dict, check_schema) -> Tools | None:
    """``tools`` and ``tool_choice`` of a chat body (None when no tools are sent). ``check_schema``:
    raises RequestError on a parameters schema the grammar cannot take (``param`` names where)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = parallel_calls(body)
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise RequestError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(400, f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    fns, seen = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or set(t) - {"type", "function"} \
                or not isinstance(f, dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise RequestError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                    "\"description\", \"parameters\", \"strict\"}}}", param=f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ or -",
                               param=f"tools[{i}].function.name")
        if name in seen:
            raise RequestError(400, f"tool {name!r} is declared twice", param=f"tools[{i}].function.name")
        seen.add(name)
        desc = f.get("description", "")
        if not isinstance(desc, str) or len(desc) > 4096:
            raise RequestError(400, f"tools[{i}].function.description must be a string of at most 4096 characters",
                               param=f"tools[{i}].function.description")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")
        if not isinstance(f.get("strict", False), bool):
            raise RequestError(400, f"tools[{i}].function.strict must be true or false",
                               param=f"tools[{i}].function.strict")
        check_schema(params, f"tools[{i}].function.parameters", bool(f.get("strict", False)))
        fns.append({"name": name, "description": desc, "parameters": params, "strict": bool(f.get("strict", False))})
    forced = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                    "\"function\": {\"name\": ...}}", param="tool_choice")
        if fn["name"] not in seen:
            raise RequestError(400, f"tool_choice names {fn['name'][:64]!r}, which is not among the tools "
                                    f"({', '.join(sorted(seen))[:300]})", param="tool_choice", code="unknown_tool")
        choice, forced = "function", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise RequestError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", param="tool_choice")
    return Tools(tuple(fns), choice, forced, parallel)


def _call_schema(f: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def constraint(tools: Tools | None) -> Constraint | None:
    """The grammar a forced call decodes under (None: free text, parsed afterwards)."""
    if tools is None or tools.choice not in ("required", "function"):
        return None
    fns = [f for f in tools.functions if tools.forced in (None, f["name"])]
    schema = _call_schema(fns[0]) if len(fns) == 1 else {"anyOf": [_call_schema(f) for f in fns]}
    if tools.choice == "required" and tools.parallel:
        schema = {"type": "array", "items": schema, "minItems": 1}
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")), strict=True)


def template_takes_tools(tokenizer) -> bool:
    """Whether the model's chat template renders a ``tools`` argument itself."""
    src = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(src, str) and "tools" in src


def system_block(tools: Tools) -> str:
    """The documented rendering for templates without tool support: one JSON line per function."""
    lines = [json.dumps({"name": f["name"], "description": f["description"], "parameters": f["parameters"]},
                        separators=(", ", ": ")) for f in tools.functions]
    return SYSTEM_HEAD + "\n".join(lines)


def _call_text(call: dict) -> str:
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": _args(fn["arguments"])}, separators=(", ", ": "))


def _args(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def prepare(messages: list[dict], tools: Tools | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, its ``tools`` argument). ``native``: the template renders
    tools (:func:`template_takes_tools`); otherwise :func:`system_block` and plain-role messages.
    Declared tools are rendered whatever ``tool_choice`` says (``none`` only stops parsing calls),
    so a conversation's prefix stays the same across its turns."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        fns = [{"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters")}}
               for f in tools.functions] if tools is not None else None
        return out, fns
    out: list[dict] = []
    names: dict[str, str] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
            text = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        elif m["role"] == "tool":
            line = f"Result of {names.get(m.get('tool_call_id'), 'the function')} " \
                   f"(call {m.get('tool_call_id')}): {m['content']}"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + line           # several results: one user turn (alternating templates)
            else:
                out.append({"role": "user", "content": line, "_tool": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools is not None:              # with tool_choice none too: the same prefix on every turn
        block = system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": block + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _objects(text: str) -> list:
    """JSON values found in ``text`` (each a whole value starting at a ``{`` or ``[``)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                v, end = dec.raw_decode(text, i)
                out.append(v)
                i = end
                continue
            except ValueError:
                pass
        i += 1
    return out


def _as_call(v, names) -> dict | None:
    if not isinstance(v, dict) or v.get("name") not in names:
        return None
    args = v.get("arguments", v.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": v["name"], "arguments": args}


_HEADS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")     # markers a call may follow text with


def _head(text: str) -> str | None:
    return text if text.strip() else None


def parse_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content before the calls or None, calls ``{"name", "arguments": dict}``) of an answer;
    no calls: (text, []). ``parallel_tool_calls: false``: the first call only (as vLLM)."""
    content, calls = _parse_calls(text, tools)
    return content, (calls[:1] if not tools.parallel else calls)


def _parse_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    names = set(tools.names)
    if "<tool_call>" in text:
        head, _, rest = text.partition("<tool_call>")
        found = [_as_call(v, names) for body in _HERMES.findall("<tool_call>" + rest) for v in _objects(body)[:1]]
        calls = [c for c in found if c]
        if calls:
            return _head(head), calls
    if "[TOOL_CALLS]" in text:
        head, _, body = text.partition("[TOOL_CALLS]")
        vals = _objects(body)
        items = vals[0] if vals and isinstance(vals[0], list) else vals
        calls = [c for c in (_as_call(v, names) for v in items) if c]
        if calls:
            return _head(head), calls
    head, tag, body = text.partition("<|python_tag|>")
    if not tag:
        head, body = "", text
    body = body.strip()
    if body.startswith("{") or body.startswith("["):
        vals = _objects(body)
        items = vals[0] if len(vals) == 1 and isinstance(vals[0], list) else vals
        calls = [c for c in (_as_call(v, names) for v in items) if c]
        if calls and len(calls) == len(items):
            return _head(head), calls
    return text, []


def openai_calls(calls: list[dict]) -> list[dict]:
    """OpenAI ``tool_calls`` entries (fresh ids; arguments as JSON text)."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]


class CallStream:
    """Streaming with tools: content is sent as it comes, except text that may be a tool call:
    an answer that starts like one (a JSON value or a family's marker) is held to the end, and
    so is everything from a marker on (and a tail that may be a marker's start). :meth:`finish`
    parses the whole answer as :func:`parse_calls` does, so the deltas add up to the
    non-streamed answer. ``hold_all``: a forced call (everything is the call)."""

    def __init__(self, tools: Tools, hold_all: bool = False):
        self.tools, self.hold_all = tools, hold_all
        self.text, self.sent = "", 0

    def _starts_call(self) -> bool:
        s = self.text.lstrip()
        return not s or any(s.startswith(m) or m.startswith(s) for m in (*_HEADS, "{", "["))

    def push(self, delta: str) -> str:
        self.text += delta
        if self.hold_all or (self.sent == 0 and self._starts_call()):
            return ""
        cut = min((i for i in (self.text.find(m) for m in _HEADS) if i >= 0), default=-1)
        if cut < 0:
            cut = len(self.text)
            for m in _HEADS:
                for k in range(len(m) - 1, 0, -1):
                    if self.text.endswith(m[:k]):
                        cut = min(cut, len(self.text) - k)
                        break
        out = self.text[self.sent:cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, calls)."""
        content, calls = parse_calls(self.text, self.tools)
        return ((content or "")[self.sent:] if calls else self.text[self.sent:]), calls
