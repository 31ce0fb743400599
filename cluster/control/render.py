"""Rendering a request's segments into token ids: the step before planning.

Pieces are joined by token ids, never by text (BPE merges differently across seams): each
skill/memory is tokenized once at registration, each template literal and field value
separately, so a field's token span is known exactly.

Every piece is priced before it is tokenised and charged after (``cluster.control.pricing``): a
request stops being tokenised as soon as it cannot fit the context window.
"""
from __future__ import annotations

import string

from cluster.control.errors import RequestError
from cluster.control.planner import RenderedRequest, RenderedSegment
from cluster.control.pricing import TokenBudget, max_token_chars
from cluster.control.registry import Registry
from cluster.control.state import TemplateRecord
from kvruntime.messages.plan import KVRef, Policy


class Renderer:
    """Turns a validated native request into a :class:`RenderedRequest` for one model."""

    def __init__(self, tokenizer, spec, registry: Registry, bos_id: int | None):
        self.tok, self.spec, self.registry, self.bos_id = tokenizer, spec, registry, bos_id
        self.max_chars = max_token_chars(tokenizer)     # characters one token stands for, at most (None: no bound)
        self._frame: tuple[int, ...] | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of user text: special-token strings in it (``<|im_start|>``...) stay plain text."""
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def markup(self, text: str) -> list[int]:
        """Token ids of the model's own chat markup (``<|im_start|>user``...): special tokens stay
        special. Never for user text (:meth:`encode`)."""
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def check_call_ids(self, messages: list[dict]) -> None:
        """Refuse a call id (``tool_call_id``, ``tool_calls[].id``) holding one of the model's
        special tokens: a chat template that renders ids renders them as markup (400 naming it)."""
        specials = [t for t in (*self.tok.all_special_tokens, *self.tok.get_added_vocab()) if t]
        for i, m in enumerate(messages):
            ids = [(f"messages[{i}].tool_call_id", m.get("tool_call_id"))] + [
                (f"messages[{i}].tool_calls[{j}].id", c.get("id")) for j, c in enumerate(m.get("tool_calls") or ())]
            for param, v in ids:
                bad = next((t for t in specials if isinstance(v, str) and t in v), None)
                if bad is not None:
                    raise RequestError(400, f"{param} may not contain the model's special token {bad!r}", param=param)

    def chat_ids(self, messages: list[dict], budget: TokenBudget | None = None,
                 tools: list[dict] | None = None, spans: list | None = None) -> list[int]:
        """The chat template applied to ``messages`` (``{"role", "content": str}``, plus
        ``tool_calls`` / ``tool_call_id`` for a template that renders tools), with the
        template's own markup tokenized as special tokens and every message's content as plain
        text: content is replaced by a sentinel while rendering, then spliced back by ids.
        ``tools``: the template's ``tools`` argument (``cluster.control.tools``); it and the
        calls are rendered by the template as markup, so no special token may appear in them.
        ``budget``: priced and charged message by message (400 as soon as the window is exceeded).
        ``spans``: when given, gets (message index, role, first token, end) of each message's content."""
        budget = budget or TokenBudget(1 << 62, 0, None)
        budget.price_chars(sum(len(m["content"].strip()) for m in messages))   # some templates trim content
        if not getattr(self.tok, "chat_template", None):
            raise RequestError(400, f"model {self.spec.name} has no chat template; use /v1/completions or "
                                    "/v1/notes/completions", param="messages")
        kw = {"tools": tools} if tools else {}
        if tools or any(m.get("tool_calls") for m in messages):
            import json
            data = json.dumps([tools, [m.get("tool_calls") for m in messages]])
            bad = [t for t in (*self.tok.all_special_tokens, *self.tok.get_added_vocab()) if t and t in data]
            if bad:
                raise RequestError(400, f"tools and tool calls may not contain the model's special token {bad[0]!r}",
                                   param="tools")
        real = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        marks = {i: f"\x00kvnotes-message-{i}\x00" for i, m in enumerate(messages) if m["content"]}
        shaped = self.tok.apply_chat_template([{**m, "content": marks.get(i, m["content"])}
                                               for i, m in enumerate(messages)],
                                              add_generation_prompt=True, tokenize=False, **kw)
        ids: list[int] = []
        rest = shaped
        for i, k in marks.items():
            head, found, rest = rest.partition(k)
            if not found:
                raise RequestError(400, "the chat template dropped a message; send it in another role",
                                   param="messages")
            c = messages[i]["content"]
            c = c if c in real else c.strip()             # templates that trim content
            head_ids = self.markup(head)
            budget.charge(len(head_ids))
            ids += head_ids
            start = len(ids)
            ids += budget.encode(self.encode, c)
            if spans is not None:       # (index, role, first token, end) of its content: explain's "message 2 (user)"
                spans.append((i, messages[i].get("role", ""), start, len(ids)))
        tail = self.markup(rest)
        budget.charge(len(tail))
        return ids + tail

    def frame(self) -> tuple[int, ...]:
        if self._frame is None:          # the same for every request: tokenised once
            self._frame = tuple(self.spec.chat_frame(self.bos_id, self.markup))
        return self._frame

    def user_then_markup(self, user: str, markup: str) -> list[int]:
        """``user`` text followed by chat markup, tokenized as one string would be up to the
        markup's first special token (so BPE merges across the seam as before: Gemma's
        ``"\nAnswer:"``), with no special token ever read from ``user``."""
        specials = {t for t in (*self.tok.all_special_tokens, *self.tok.get_added_vocab()) if t and t in markup}
        cut = min((markup.index(t) for t in specials), default=len(markup))
        return self.encode(user + markup[:cut]) + (self.markup(markup[cut:]) if markup[cut:] else [])

    def chunk_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text.strip() + "\n\n"))

    @property
    def chunk_position(self) -> int:
        """Canonical position of a precompiled chunk's first slot (``kvruntime.ops.precompile_chunk``)."""
        return 0 if self.bos_id is None else 1

    def chunk_ref(self, token_ids: tuple[int, ...], salt: str) -> KVRef:
        """Content address of a registered chunk's KV (exact, at its canonical position)."""
        return KVRef(tuple(token_ids), self.chunk_position, salt)

    def render_template(self, t: TemplateRecord, values: dict) -> RenderedSegment:
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
                               labels=t.labels, version=t.version)

    def render(self, request_id: str, tenant: str, segments: list[dict], policy: Policy,
               session: str | None, salt: str, budget: TokenBudget | None = None) -> RenderedRequest:
        """``segments``: validated dicts with exactly one of skill/memory/template/text; ``salt``:
        the tenant's key salt (registered chunks are referenced by content under it); ``budget``:
        priced and charged segment by segment (400 as soon as the window is exceeded). The
        trailing text segments (the question) are tokenised joined, as one piece."""
        budget = budget or TokenBudget(1 << 62, 0, None)
        budget.price_chars(text_chars(segments))
        ctx = [RenderedSegment("frame", None, self.frame())] if self.frame() else []
        budget.charge(len(ctx[0].token_ids) if ctx else 0)
        trailing: list[str] = []
        for seg in segments:
            if "text" in seg:
                trailing.append(seg["text"])
                continue
            for t in trailing:                      # text followed by more context is context
                ctx.append(RenderedSegment("text", None, tuple(budget.encode(self.encode, t))))
            trailing = []
            if "skill" in seg or "memory" in seg:
                kind = "skill" if "skill" in seg else "memory"
                c = self.registry.chunk(tenant, kind, seg[kind])
                budget.charge(len(c.token_ids))
                ctx.append(RenderedSegment(kind, c.name, c.token_ids, kv=self.chunk_ref(c.token_ids, salt)))
            elif "template" in seg:
                fields = seg.get("fields", {})
                budget.price_chars(text_chars([seg]))
                ctx.append(self.render_template(self.registry.template(tenant, seg["template"]), fields))
                budget.charge(len(ctx[-1].token_ids))
        question = "".join(trailing)
        budget.price_chars(len(question))
        suffix = tuple(self.user_then_markup(question, self.spec.chat_user_suffix))
        budget.charge(len(suffix))
        return RenderedRequest(request_id, self.spec.name, policy, tuple(ctx), suffix, session)

    def render_prompt(self, request_id: str, prompt_ids: list[int], policy: Policy) -> RenderedRequest:
        """Plain (OpenAI) prompt: all tokens but the last are the prefix; the last is the suffix."""
        if not prompt_ids:
            raise RequestError(400, "prompt is empty")
        prefix = tuple(prompt_ids[:-1])
        ctx = (RenderedSegment("prompt", None, prefix),) if prefix else ()
        return RenderedRequest(request_id, self.spec.name, policy, ctx, (prompt_ids[-1],), None)


def text_chars(segments: list[dict]) -> int:
    """Characters of caller text in native ``segments`` (texts and string template fields): a
    lower bound's input, since registered pieces and markup only add tokens."""
    n = 0
    for seg in segments:
        if isinstance(seg.get("text"), str):
            n += len(seg["text"])
        fields = seg.get("fields")
        if isinstance(fields, dict):
            n += sum(len(v) for v in fields.values() if isinstance(v, str))
    return n
