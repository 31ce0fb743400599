"""Validation of request bodies: every caller mistake becomes a RequestError (HTTP 4xx) whose
message names the parameter. Nothing here touches the model or the tier."""
from __future__ import annotations

from cluster.errors import RequestError
from kvruntime.messages.decode import SamplingParams

POLICIES = ("exact", "balanced", "fast")
_NATIVE_KEYS = {"model", "session", "segments", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                "kv_policy", "explain", "edit_strategy"}
EDIT_STRATEGIES = ("auto", "erratum", "edit_in_place")
_OPENAI_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "user", "n",
                  "kv_policy", "explain", "stream_options", "max_completion_tokens"}


def _num(body, key, default, lo, hi, *, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(400, f"{key} must be {'an integer' if integer else 'a number'}", param=key)
    if not lo <= v <= hi:
        raise RequestError(400, f"{key} must be between {lo} and {hi}, got {v}", param=key)
    return v


def _bool(body, key, default=False) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(400, f"{key} must be true or false", param=key)
    return v


def sampling_from(body: dict, *, default_max_tokens: int, limit: int) -> SamplingParams:
    mt = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    max_tokens = _num({"max_tokens": mt}, "max_tokens", default_max_tokens, 1, limit, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        raise RequestError(400, "stop must be a string or a list of at most 4 non-empty strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "seed must be an integer", param="seed")
    return SamplingParams(max_tokens=max_tokens, temperature=float(_num(body, "temperature", 1.0, 0.0, 2.0)),
                          top_p=float(_num(body, "top_p", 1.0, 1e-6, 1.0)), seed=seed, stop=stop)


def common_options(body: dict, model: str) -> tuple[str | None, bool, bool]:
    """(kv_policy, stream, explain) after checking the model name."""
    m = body.get("model", model)
    if not isinstance(m, str) or m != model:
        raise RequestError(404, f"model {m!r} is not served here; this server serves {model!r}",
                           code="model_not_found", param="model")
    pol = body.get("kv_policy")
    if pol is not None and pol not in POLICIES:
        raise RequestError(400, f"kv_policy must be one of {', '.join(POLICIES)}", param="kv_policy")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(400, "only n=1 is supported", param="n")
    return pol, _bool(body, "stream"), _bool(body, "explain")


def edit_strategy(body: dict) -> str:
    v = body.get("edit_strategy", "auto")
    if v not in EDIT_STRATEGIES:
        raise RequestError(400, f"edit_strategy must be one of {', '.join(EDIT_STRATEGIES)}", param="edit_strategy")
    return v


def native_body(body) -> tuple[list[dict], str | None]:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    unknown = set(body) - _NATIVE_KEYS
    if unknown:
        raise RequestError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
    segs = body.get("segments")
    if not isinstance(segs, list) or not segs:
        raise RequestError(400, "segments must be a non-empty list", param="segments")
    if len(segs) > 256:
        raise RequestError(400, "at most 256 segments per request", param="segments")
    out = []
    for i, s in enumerate(segs):
        kinds = [k for k in ("skill", "memory", "template", "text") if isinstance(s, dict) and k in s]
        if not isinstance(s, dict) or len(kinds) != 1 or set(s) - {kinds[0], "fields"} or (
                "fields" in s and kinds[0] != "template"):
            raise RequestError(400, f"segments[{i}] must be an object with exactly one of skill, memory, "
                                    f"template (+ fields) or text", param=f"segments[{i}]")
        v = s[kinds[0]]
        if not isinstance(v, str) or not v.strip():
            raise RequestError(400, f"segments[{i}].{kinds[0]} must be a non-empty string", param=f"segments[{i}]")
        out.append(s)
    session = body.get("session")
    if session is not None and (not isinstance(session, str) or not session.strip() or len(session) > 128):
        raise RequestError(400, "session must be a non-empty string of at most 128 characters", param="session")
    return out, session


def completions_prompt(body, encode) -> list[int]:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    unknown = set(body) - _OPENAI_COMMON - {"prompt", "echo", "logprobs", "suffix"}
    if unknown:
        raise RequestError(400, f"unsupported field(s): {', '.join(sorted(unknown))}")
    if body.get("echo") or body.get("logprobs") is not None or body.get("suffix") is not None:
        raise RequestError(400, "echo, logprobs and suffix are not supported")
    p = body.get("prompt")
    if isinstance(p, str) and p:
        return encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return list(p)
    raise RequestError(400, "prompt must be a non-empty string or a list of token ids (batches are not supported)",
                       param="prompt")


def chat_messages(body) -> list[dict]:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    unknown = set(body) - _OPENAI_COMMON - {"messages"}
    if unknown:
        raise RequestError(400, f"unsupported field(s): {', '.join(sorted(unknown))}")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise RequestError(400, f"messages[{i}] must have role system|user|assistant and string content",
                               param=f"messages[{i}]")
    return msgs
