"""Registries of named context (skills, memories, templates) and rendering a request's
segments into token ids: the step before planning.

Pieces are joined by token ids, never by text (BPE merges differently across seams): each
skill/memory is tokenized once at registration, each template literal and field value
separately, so a field's token span is known exactly.
"""
from __future__ import annotations

import hashlib
import string
import threading
from dataclasses import dataclass

from cluster.errors import RequestError
from kvruntime.messages.plan import Policy
from cluster.planner import RenderedRequest, RenderedSegment

MAX_NAME = 128


def chunk_key(model_id: str, dtype: str, tenant: str, token_ids) -> str:
    """Tier key of a chunk precompiled at its canonical position: everything that changes the
    KV bytes (model weights id incl. RoPE config, dtype, position, tokens) plus the tenant."""
    h = hashlib.sha256(f"{model_id}|{dtype}|canonical-after-bos|{tenant}|".encode())
    h.update(",".join(map(str, token_ids)).encode())
    return "chunk-" + h.hexdigest()[:32]


@dataclass(frozen=True)
class Chunk:
    kind: str                       # "skill" | "memory"
    name: str
    tenant: str
    text: str
    token_ids: tuple[int, ...]      # text + "\n\n", tokenized once
    key: str                        # tier key (chunk_key)


@dataclass(frozen=True)
class Template:
    name: str
    tenant: str
    text: str                                    # str.format template
    fields: tuple[str, ...]                      # placeholders in order of appearance
    labels: tuple[tuple[str, str], ...] = ()     # field -> human label for errata


def _check_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
        raise RequestError(400, f"name must be a non-empty string of at most {MAX_NAME} characters")
    return name


class Registry:
    """Named skills, memories and templates per tenant. Thread-safe."""

    def __init__(self):
        self._chunks: dict[tuple[str, str, str], Chunk] = {}     # (tenant, kind, name) -> chunk
        self._templates: dict[tuple[str, str], Template] = {}    # (tenant, name) -> template
        self._lock = threading.Lock()

    def add_chunk(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunks[(chunk.tenant, chunk.kind, chunk.name)] = chunk

    def chunk(self, tenant: str, kind: str, name: str) -> Chunk:
        with self._lock:
            c = self._chunks.get((tenant, kind, name))
        if c is None:
            raise RequestError(404, f"unknown {kind} {name!r}; register it with POST /v1/{kind}s", code=f"{kind}_not_found")
        return c

    def chunks(self, tenant: str, kind: str) -> list[Chunk]:
        with self._lock:
            return [c for (t, k, _), c in sorted(self._chunks.items()) if t == tenant and k == kind]

    def remove_chunk(self, tenant: str, kind: str, name: str) -> Chunk:
        c = self.chunk(tenant, kind, name)
        with self._lock:
            self._chunks.pop((tenant, kind, name), None)
        return c

    def add_template(self, tenant: str, name: str, text: str, labels: dict | None = None) -> Template:
        _check_name(name)
        if not isinstance(text, str) or not text.strip():
            raise RequestError(400, "template text must be a non-empty string")
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise RequestError(400, f"template text is not a valid {{field}} template: {exc}") from None
        fields = []
        for _, f, spec, conv in parsed:
            if f is None:
                continue
            if not f.isidentifier() or spec or conv:
                raise RequestError(400, f"template placeholder {{{f}}} must be a plain identifier")
            if f in fields:
                raise RequestError(400, f"template placeholder {{{f}}} appears twice; each field must appear once")
            fields.append(f)
        if not fields:
            raise RequestError(400, "template has no {field} placeholders; register plain text as a skill")
        labels = labels or {}
        if not isinstance(labels, dict) or set(labels) - set(fields):
            raise RequestError(400, "labels must map template fields to human-readable names")
        t = Template(name, tenant, text, tuple(fields), tuple(sorted(labels.items())))
        with self._lock:
            self._templates[(tenant, name)] = t
        return t

    def template(self, tenant: str, name: str) -> Template:
        with self._lock:
            t = self._templates.get((tenant, name))
        if t is None:
            raise RequestError(404, f"unknown template {name!r}; register it with POST /v1/templates",
                               code="template_not_found")
        return t

    def templates(self, tenant: str) -> list[Template]:
        with self._lock:
            return [t for (tn, _), t in sorted(self._templates.items()) if tn == tenant]

    def remove_template(self, tenant: str, name: str) -> Template:
        t = self.template(tenant, name)
        with self._lock:
            self._templates.pop((tenant, name), None)
        return t


class Renderer:
    """Turns a validated native request into a :class:`RenderedRequest` for one model."""

    def __init__(self, tokenizer, spec, registry: Registry, bos_id: int | None):
        self.tok, self.spec, self.registry, self.bos_id = tokenizer, spec, registry, bos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def frame(self) -> tuple[int, ...]:
        ids = [self.bos_id] if self.spec.prepend_bos and self.bos_id is not None else []
        return tuple(ids + (self.encode(self.spec.chat_user_prefix) if self.spec.chat_user_prefix else []))

    def chunk_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text.strip() + "\n\n"))

    def render_template(self, t: Template, values: dict) -> RenderedSegment:
        if not isinstance(values, dict):
            raise RequestError(400, f"template {t.name!r}: fields must be an object")
        missing = [f for f in t.fields if f not in values]
        if missing:
            raise RequestError(400, f"template {t.name!r}: missing field(s) {', '.join(missing)}", code="missing_field")
        extra = set(values) - set(t.fields)
        if extra:
            raise RequestError(400, f"template {t.name!r} has no field(s) {', '.join(sorted(extra))}")
        ids: list[int] = []
        spans, fields = [], []
        for literal, f, _, _ in string.Formatter().parse(t.text):
            if literal:
                ids += self.encode(literal)
            if f is not None:
                v = values[f]
                if not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
                    raise RequestError(400, f"template {t.name!r}: field {f!r} must be a non-empty string or number")
                v = str(v)
                vid = self.encode(v)
                spans.append((f, len(ids), len(ids) + len(vid)))
                fields.append((f, v))
                ids += vid
        return RenderedSegment("template", t.name, tuple(ids), fields=tuple(fields), field_spans=tuple(spans),
                               labels=t.labels)

    def render(self, request_id: str, tenant: str, segments: list[dict], policy: Policy,
               session: str | None) -> RenderedRequest:
        """``segments``: validated dicts with exactly one of skill/memory/template/text."""
        ctx = [RenderedSegment("frame", None, self.frame())] if self.frame() else []
        trailing: list[str] = []
        for seg in segments:
            if "text" in seg:
                trailing.append(seg["text"])
                continue
            for t in trailing:                      # text followed by more context is context
                ctx.append(RenderedSegment("text", None, tuple(self.encode(t))))
            trailing = []
            if "skill" in seg or "memory" in seg:
                kind = "skill" if "skill" in seg else "memory"
                c = self.registry.chunk(tenant, kind, seg[kind])
                ctx.append(RenderedSegment(kind, c.name, c.token_ids, chunk_key=c.key))
            elif "template" in seg:
                ctx.append(self.render_template(self.registry.template(tenant, seg["template"]), seg.get("fields", {})))
        suffix = tuple(self.encode("".join(trailing) + self.spec.chat_user_suffix))
        return RenderedRequest(request_id, self.spec.name, policy, tuple(ctx), suffix, session)

    def render_prompt(self, request_id: str, prompt_ids: list[int], policy: Policy) -> RenderedRequest:
        """Plain (OpenAI) prompt: all tokens but the last are the prefix; the last is the suffix."""
        if not prompt_ids:
            raise RequestError(400, "prompt is empty")
        prefix = tuple(prompt_ids[:-1])
        ctx = (RenderedSegment("prompt", None, prefix),) if prefix else ()
        return RenderedRequest(request_id, self.spec.name, policy, ctx, (prompt_ids[-1],), None)
