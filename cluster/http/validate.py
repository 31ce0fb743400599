"""Validation of request bodies: every caller mistake becomes a RequestError (HTTP 4xx) whose
message names the parameter; sizes come from :class:`~cluster.control.limits.RequestLimits`. Nothing
here touches the model or the tier. Bodies are already JSON objects (``cluster.http.body.parse_json``).

OpenAI fields accepted: the sampling ones (``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``logprobs`` / ``top_logprobs``), ``stream`` / ``stream_options``, ``n`` (up to
``max_choices``), ``user``, ``metadata``, ``store: false``, ``response_format`` (checked by
``cluster.http.structured``), ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (chat,
``cluster.control.tools``); completions also take a batch of prompts (strings or token-id lists,
one choice per prompt and ``n``) and ``echo``. kvnotes' own fields (the official client's
``extra_body``): ``kv_policy``, ``explain``, ``deadline_s`` and ``edit_strategy`` (a prompt found
one span away from a held one: ``auto`` | ``erratum`` | ``edit_in_place``, as on the native API);
anything else is a 400 naming the field. Chat
messages: ``system``, ``developer``, ``user``, ``assistant`` (with ``tool_calls``) and ``tool``
(with ``tool_call_id``)."""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits, check_name, check_text
from kvruntime.config.policy import POLICIES
from kvruntime.messages.decode import MAX_TOP_LOGPROBS, SEED_MAX, SamplingParams

EDIT_STRATEGIES = ("auto", "erratum", "edit_in_place")
_SAMPLING = {"max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
             "logit_bias"}
_NATIVE_KEYS = _SAMPLING | {"model", "session", "segments", "stream", "kv_policy", "explain", "edit_strategy",
                            "deadline_s", "response_format"}
_OPENAI_COMMON = _SAMPLING | {"model", "stream", "user", "n", "kv_policy", "explain", "stream_options", "deadline_s",
                              "edit_strategy", "max_completion_tokens", "metadata", "store", "response_format", "tools",
                              "tool_choice", "logprobs"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _num(body, key, default, lo, hi, *, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(400, f"{key} must be {'an integer' if integer else 'a number'}", param=key)
    if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
        shown = v if not isinstance(v, int) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
        raise RequestError(400, f"{key} must be between {lo} and {hi}, got {shown}", param=key)
    return v


def _bool(body, key, default=False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"{key} must be true or false", param=key)
    return v


def _logit_bias(body, vocab: int) -> tuple[tuple[int, float], ...]:
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict) or len(lb) > 300:
        raise RequestError(400, "logit_bias must be an object of at most 300 token id -> bias entries",
                           param="logit_bias")
    out = []
    for k, b in lb.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 9) or int(k) >= vocab:
            raise RequestError(400, f"logit_bias key {k[:20]!r} is not a token id below {vocab}", param="logit_bias")
        _num({"logit_bias": b}, "logit_bias", 0, -100, 100)
        out.append((int(k), float(b)))
    return tuple(sorted(out))


def sampling_from(body: dict, *, default_max_tokens: int, limits: RequestLimits, vocab: int,
                  logprobs: int | None = None) -> SamplingParams:
    """Sampling parameters. An unseeded request that samples (temperature > 0) gets a random seed,
    so two such requests differ; a seeded one is reproducible."""
    if "max_completion_tokens" in body and body.get("max_tokens") is not None:
        raise RequestError(400, "send max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    mt = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    max_tokens = _num({"max_tokens": mt}, "max_tokens", default_max_tokens, 1, limits.max_tokens, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if not (isinstance(stop, (list, tuple)) and len(stop) <= limits.max_stop
            and all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stop)):
        raise RequestError(400, f"stop must be a string or a list of at most {limits.max_stop} non-empty strings of "
                                f"at most {limits.max_stop_chars} characters", param="stop")
    temperature = float(_num(body, "temperature", 1.0, 0.0, 2.0))
    seed = _num(body, "seed", None, 0, SEED_MAX, integer=True)
    if seed is None and temperature > 0:
        seed = secrets.randbits(63)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          top_p=float(_num(body, "top_p", 1.0, 1e-9, 1.0)), seed=seed, stop=tuple(stop),
                          presence_penalty=float(_num(body, "presence_penalty", 0.0, -2.0, 2.0)),
                          frequency_penalty=float(_num(body, "frequency_penalty", 0.0, -2.0, 2.0)),
                          logit_bias=_logit_bias(body, vocab), logprobs=logprobs)


def common_options(body: dict, model: str) -> tuple[str | None, bool, bool]:
    """(kv_policy, stream, explain) after checking the model name."""
    m = body.get("model", model)
    if not isinstance(m, str):
        raise RequestError(400, "model must be a string", param="model")
    if m != model:
        raise RequestError(404, f"model {m[:200]!r} is not served here; this server serves {model!r}",
                           code="model_not_found", param="model")
    pol = body.get("kv_policy")
    if pol is not None and pol not in POLICIES:
        raise RequestError(400, f"kv_policy must be one of {', '.join(POLICIES)}", param="kv_policy")
    return pol, _bool(body, "stream"), _bool(body, "explain")


def choices(body: dict, limits: RequestLimits) -> int:
    """``n``: how many independent samples to return (1..``max_choices``)."""
    return _num(body, "n", 1, 1, limits.max_choices, integer=True)


def openai_extras(body: dict, *, chat: bool) -> tuple[int | None, bool]:
    """Check the OpenAI fields that change nothing here or must keep their default; returns
    (logprobs: None or the number of top log-probs, include_usage in the stream). ``n``,
    ``response_format`` and ``tools`` are checked by :func:`choices`, ``cluster.http.structured``
    and ``cluster.control.tools``."""
    if body.get("user") is not None and (not isinstance(body["user"], str) or len(body["user"]) > 256):
        raise RequestError(400, "user must be a string of at most 256 characters", param="user")
    md = body.get("metadata")
    if md is not None and (not isinstance(md, dict) or len(md) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in md.items())):
        raise RequestError(400, "metadata must be an object of at most 16 string -> string pairs", param="metadata")
    if body.get("store") not in (None, False):
        raise RequestError(400, "store: true is not supported (completions are not stored)", param="store")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}
                           or not isinstance(so.get("include_usage", True), bool)):
        raise RequestError(400, "stream_options may only hold include_usage: true|false", param="stream_options")
    usage = bool((so or {}).get("include_usage", True))
    if chat:
        lp = _bool(body, "logprobs")
        top = _num(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        if top is not None and not lp:
            raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if lp else None, usage
    return _num(body, "logprobs", None, 0, 5, integer=True), usage


def deadline_s(body: dict) -> float | None:
    """The request's own deadline in seconds (at most the server's ``request_deadline_s``, which
    the router applies); None: the server's."""
    return _num(body, "deadline_s", None, 0.001, 86400.0)


def edit_strategy(body: dict) -> str:
    """How a found or declared edit is planned: ``auto`` (edit-in-place where the policy allows it,
    else recompute from the divergence), ``erratum`` (asked for: the held prompt + an appended
    correction, which changes the prompt the model reads) or ``edit_in_place``; null: ``auto``."""
    v = body.get("edit_strategy", "auto")
    if v is None:
        return "auto"
    if not isinstance(v, str) or v not in EDIT_STRATEGIES:
        raise RequestError(400, f"edit_strategy must be one of {', '.join(EDIT_STRATEGIES)}", param="edit_strategy")
    return v


def native_body(body: dict, limits: RequestLimits) -> tuple[list[dict], str | None]:
    unknown = set(body) - _NATIVE_KEYS
    if unknown:
        raise RequestError(400, f"unknown field(s): {', '.join(sorted(unknown))[:300]}", param=sorted(unknown)[0][:64])
    segs = body.get("segments")
    if not isinstance(segs, list) or not segs:
        raise RequestError(400, "segments must be a non-empty list", param="segments")
    if len(segs) > limits.max_segments:
        raise RequestError(400, f"at most {limits.max_segments} segments per request", param="segments")
    out = []
    for i, s in enumerate(segs):
        kinds = [k for k in ("skill", "memory", "template", "text") if isinstance(s, dict) and k in s]
        if not isinstance(s, dict) or len(kinds) != 1 or set(s) - {kinds[0], "fields"} or (
                "fields" in s and kinds[0] != "template"):
            raise RequestError(400, f"segments[{i}] must be an object with exactly one of skill, memory, "
                                    f"template (+ fields) or text", param=f"segments[{i}]")
        kind = kinds[0]
        if kind == "text":
            check_text(s[kind], limits, f"segments[{i}].text")
        else:
            check_name(s[kind], limits, what=f"segments[{i}].{kind}")
        fields = s.get("fields", {})
        if not isinstance(fields, dict) or len(fields) > limits.max_template_fields:
            raise RequestError(400, f"segments[{i}].fields must be an object of at most {limits.max_template_fields} "
                                    "fields", param=f"segments[{i}].fields")
        for k, v in fields.items():
            if isinstance(v, str):
                check_text(v, limits, f"segments[{i}].fields.{k[:64]}")
        out.append(s)
    session = body.get("session")
    if session is not None:
        check_name(session, limits, what="session")
    return out, session


def _one_prompt(p, limits: RequestLimits, param: str) -> str | list[int] | None:
    """A prompt as a string or token ids; None when ``p`` is neither."""
    if isinstance(p, str) and p:
        if len(p) > limits.max_text_chars:
            raise RequestError(400, f"{param} is {len(p)} characters; the limit is {limits.max_text_chars}",
                               param=param)
        return p
    if isinstance(p, list) and p and len(p) <= limits.max_text_chars and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in p):
        return list(p)
    return None


def completions_prompt(body: dict, limits: RequestLimits) -> list[str | list[int]]:
    """The prompts, in order: one string or token-id list, or a batch (a list of either); each is
    tokenized by the caller, off the event loop. A batch runs as one choice per prompt and ``n``
    (``index`` = prompt * n + choice, as vLLM)."""
    unknown = set(body) - _OPENAI_COMMON - {"prompt", "echo", "suffix"}
    if unknown:
        raise RequestError(400, f"unsupported field(s): {', '.join(sorted(unknown))[:300]}",
                           param=sorted(unknown)[0][:64])
    _bool(body, "echo")
    if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none"):
        raise RequestError(400, "tools are accepted on /v1/chat/completions only", param="tools")
    if body.get("suffix") is not None:
        raise RequestError(400, "suffix is not supported", param="suffix")
    p = body.get("prompt")
    one = _one_prompt(p, limits, "prompt")
    if one is not None:
        return [one]
    if isinstance(p, list) and p and any(isinstance(x, (str, list)) for x in p):     # a batch
        if len(p) > limits.max_segments:
            raise RequestError(400, f"at most {limits.max_segments} prompts per request", param="prompt")
        out = [_one_prompt(x, limits, f"prompt[{i}]") for i, x in enumerate(p)]
        bad = next((i for i, x in enumerate(out) if x is None), None)
        if bad is None:
            return out
        raise RequestError(400, f"prompt[{bad}] must be a non-empty string or a list of token ids",
                           param=f"prompt[{bad}]")
    raise RequestError(400, "prompt must be a non-empty string, a list of token ids, or a list of either "
                            "(a batch)", param="prompt")


def _tool_calls(i: int, calls) -> list[dict]:
    if not isinstance(calls, list) or not calls or len(calls) > 64:
        raise RequestError(400, f"messages[{i}].tool_calls must be a non-empty list", param=f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str) \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str) or len(fn["arguments"]) > 1 << 16:
            raise RequestError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                    "\"function\": {\"name\", \"arguments\": JSON text}}",
                               param=f"messages[{i}].tool_calls[{j}]")
        out.append({"id": c["id"][:128], "type": "function",
                    "function": {"name": fn["name"][:64], "arguments": fn["arguments"]}})
    return out


def _content(i: int, c, limits: RequestLimits, *, optional: bool = False) -> str:
    if c is None and optional:
        return ""
    if isinstance(c, list):
        if not c or not all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                            and isinstance(p["text"], str) for p in c):
            raise RequestError(400, f"messages[{i}].content parts must all be {{\"type\": \"text\", \"text\": "
                                    "...}", param=f"messages[{i}].content")
        c = "".join(p["text"] for p in c)
    if optional and c == "":
        return c
    return check_text(c, limits, f"messages[{i}].content")


def chat_messages(body: dict, limits: RequestLimits) -> list[dict]:
    """Messages as ``{"role", "content": str}``: ``developer`` is the system role; content given as
    a list of ``{"type": "text", "text": ...}`` parts is joined. ``assistant`` messages may carry
    ``tool_calls`` (content then optional), ``tool`` messages carry ``tool_call_id``."""
    unknown = set(body) - _OPENAI_COMMON - {"messages", "top_logprobs", "parallel_tool_calls"}
    if unknown:
        raise RequestError(400, f"unsupported field(s): {', '.join(sorted(unknown))[:300]}",
                           param=sorted(unknown)[0][:64])
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    if len(msgs) > limits.max_segments:
        raise RequestError(400, f"at most {limits.max_segments} messages per request", param="messages")
    out = []
    allowed = {"assistant": {"role", "content", "tool_calls", "refusal"}, "tool": {"role", "content", "tool_call_id"}}
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES or set(m) - allowed.get(role, {"role", "content"}):
            raise RequestError(400, f"messages[{i}] must have role system|developer|user|assistant|tool and content "
                                    "(assistant: tool_calls too; tool: tool_call_id)", param=f"messages[{i}]")
        calls = _tool_calls(i, m["tool_calls"]) if role == "assistant" and m.get("tool_calls") is not None else None
        c = _content(i, m.get("content"), limits, optional=calls is not None)
        msg = {"role": "system" if role == "developer" else role, "content": c}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise RequestError(400, f"messages[{i}].tool_call_id must be the id of the call it answers",
                                   param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"][:128]
        out.append(msg)
    return out


@dataclass(frozen=True)
class NativeRequest:
    """A ``/v1/notes/completions`` body, validated once (:func:`native_request`)."""
    policy: str | None
    stream: bool
    explain: bool
    segments: list
    session: str | None
    sampling: SamplingParams
    edit: str
    deadline_s: float | None


def native_request(body: dict, limits: RequestLimits, *, model: str, vocab: int) -> NativeRequest:
    """Every check of a native body, in one pass; the value goes on to the router as is."""
    policy, stream, explain = common_options(body, model)
    segments, session = native_body(body, limits)
    return NativeRequest(policy, stream, explain, segments, session,
                         sampling_from(body, default_max_tokens=64, limits=limits, vocab=vocab),
                         edit_strategy(body), deadline_s(body))


@dataclass(frozen=True)
class OpenAIRequest:
    """A ``/v1/completions`` or ``/v1/chat/completions`` body, validated once (:func:`openai_request`):
    ``messages`` (chat) or ``prompts`` (each a string or token ids) is set."""
    policy: str | None
    stream: bool
    explain: bool
    include_usage: bool
    sampling: SamplingParams
    deadline_s: float | None
    n: int = 1                                  # independent choices (``choices``)
    messages: list | None = None
    prompts: tuple = ()                         # completions: each prompt a string or token ids
    echo: bool = False                          # completions: the prompt before each choice's text
    edit: str = "auto"                          # edit_strategy (validate.EDIT_STRATEGIES)


def openai_request(body: dict, limits: RequestLimits, *, model: str, vocab: int, chat: bool) -> OpenAIRequest:
    """Every check of an OpenAI body, in one pass."""
    policy, stream, explain = common_options(body, model)
    logprobs, include_usage = openai_extras(body, chat=chat)
    sampling = sampling_from(body, default_max_tokens=16, limits=limits, vocab=vocab, logprobs=logprobs)
    n, edit = choices(body, limits), edit_strategy(body)
    if chat:
        return OpenAIRequest(policy, stream, explain, include_usage, sampling, deadline_s(body), n=n,
                             messages=chat_messages(body, limits), edit=edit)
    prompts = completions_prompt(body, limits)
    if len(prompts) * n > limits.max_segments:
        raise RequestError(400, f"{len(prompts)} prompts x n={n} is more than {limits.max_segments} choices",
                           param="n")
    return OpenAIRequest(policy, stream, explain, include_usage, sampling, deadline_s(body), n=n,
                         prompts=tuple(prompts), echo=_bool(body, "echo"), edit=edit)
