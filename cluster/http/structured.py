"""Validation of structured-output requests: ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``strict``) and the JSON schemas of tool parameters. A schema is refused
with a 400 (``code: invalid_schema``) naming the problem: not valid JSON Schema (its meta-schema,
``jsonschema``), or a construct the grammar compiler cannot enforce (xgrammar's own message).
The accepted constraint travels to the decode worker inside ``SamplingParams.constraint``.

Semantics are vLLM's (its xgrammar backend compiles every schema in xgrammar's strict mode): a
property or item the schema does not name is refused unless the schema allows it
(``additionalProperties: true`` or a schema, ``items`` / ``prefixItems`` open), whether the
request says ``strict: true`` or not, so every ``json_schema`` constraint is built with
``strict=True``. OpenAI's own service leaves a non-strict schema unconstrained instead.

Checks are cached (:data:`MAX_CHECKED` schemas, LRU, the refusals too) and the callers run them
in a worker thread (``cluster.http.api``): a body of 128 tool schemas is checked off the event
loop, and once per distinct schema."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from cluster.control.errors import RequestError
from kvruntime.messages.decode import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_SCHEMA_CHARS = 64 << 10
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")     # xgrammar's "[hh:mm:ss] file.cc:line: " before its message
MAX_CHECKED = 512                  # schemas whose check result is kept (LRU)
_checked: OrderedDict[str, str | None] = OrderedDict()    # canonical text -> refusal message (None: accepted)
_checked_lock = threading.Lock()


def canonical(schema: dict) -> str:
    """One schema, one text (compact; key order kept: it is the order properties are generated in):
    the grammar cache's key."""
    return json.dumps(schema, separators=(",", ":"))


def check_schema(schema, param: str, strict: bool = True) -> str:
    """The canonical text of ``schema`` after checking that it is a JSON schema the grammar can
    enforce; RequestError(400, invalid_schema) naming ``param`` and the problem otherwise. Blocking
    (jsonschema, xgrammar): call it from a worker thread. ``strict`` is accepted for callers that
    pass the request's flag; every schema is checked as it is compiled, in strict mode."""
    if not isinstance(schema, dict):
        raise RequestError(400, f"{param} must be a JSON schema object", param=param, code="invalid_schema")
    text = canonical(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise RequestError(400, f"{param} is {len(text)} characters; the limit is {MAX_SCHEMA_CHARS}", param=param,
                           code="invalid_schema")
    with _checked_lock:
        known = text in _checked
        why = _checked.get(text)
        if known:
            _checked.move_to_end(text)
    if not known:
        why = _refusal(schema, text)
        with _checked_lock:
            _checked[text] = why
            while len(_checked) > MAX_CHECKED:
                _checked.popitem(last=False)
    if why is not None:
        raise RequestError(400, f"{param} {why}", param=param, code="invalid_schema")
    return text


def _refusal(schema: dict, text: str) -> str | None:
    """Why ``schema`` cannot be a constraint (the message after the parameter's name), or None."""
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"is not a valid JSON schema at {where}: {exc.message[:300]}"
    from decode_workers.structured import grammar_of
    try:
        grammar_of(Constraint("json_schema", text, True))
    except Exception as exc:  # xgrammar refuses what it cannot enforce; its message names the construct
        why = _LOG_PREFIX.sub("", (str(exc).splitlines() or [repr(exc)])[0].strip("'\" ")) or repr(exc)
        return f"cannot be enforced: {why[:300]}"
    return None


def response_format(body: dict) -> Constraint | None:
    """The constraint ``response_format`` asks for (None: free text)."""
    rf = body.get("response_format")
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           param="response_format")
    if rf["type"] in ("text", "json_object"):
        if set(rf) != {"type"}:
            raise RequestError(400, f"response_format {rf['type']} takes no other field", param="response_format")
        return None if rf["type"] == "text" else Constraint("json_object")
    js = rf.get("json_schema")
    if set(rf) != {"type", "json_schema"} or not isinstance(js, dict) \
            or set(js) - {"name", "description", "schema", "strict"}:
        raise RequestError(400, "response_format json_schema must be {\"type\": \"json_schema\", \"json_schema\": "
                                "{\"name\", \"description\", \"schema\", \"strict\"}}", param="response_format")
    if not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
        raise RequestError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                           param="response_format.json_schema.name")
    strict = js.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise RequestError(400, "response_format.json_schema.strict must be true or false",
                           param="response_format.json_schema.strict")
    if "schema" not in js:
        raise RequestError(400, "response_format.json_schema.schema is missing", param="response_format.json_schema.schema",
                           code="invalid_schema")
    # strict or not, compiled as vLLM does: no unlisted properties unless the schema allows them
    return Constraint("json_schema", check_schema(js["schema"], "response_format.json_schema.schema"), True)
