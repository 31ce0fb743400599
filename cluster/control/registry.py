"""Named context per tenant -- skills, memories, templates -- kept in the state store, so every
router replica sees the same registrations and a restart loses none. Validation of names and
template text lives here; the KV itself is addressed by content (``KVRef``), never by name."""
from __future__ import annotations

import hashlib
import re
import string
import time

from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits
from cluster.control.state import Registration, StateStore, TemplateRecord
from cluster.control.limits import check_name, check_text

_FIELD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_LABEL_RE = re.compile(r"[^\x00-\x1f{}\x7f]+")


def parse_template(text, labels, limits: RequestLimits | None = None
                   ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(fields in order, labels) of a ``{field}`` template; ``RequestError`` 400 when invalid.
    Fields are identifiers starting with a letter; labels are one line of text (no braces)."""
    limits = limits or RequestLimits()
    check_text(text, limits, "text")
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise RequestError(400, f"template text is not a valid {{field}} template: {exc}", param="text") from None
    fields: list[str] = []
    for _, f, spec, conv in parsed:
        if f is None:
            continue
        if not _FIELD_RE.fullmatch(f) or spec or conv:
            raise RequestError(400, f"template placeholder {{{f[:64]}}} must be a plain identifier starting with a "
                                    "letter (at most 64 characters)", param="text")
        if f in fields:
            raise RequestError(400, f"template placeholder {{{f}}} appears twice; each field must appear once",
                               param="text")
        fields.append(f)
        if len(fields) > limits.max_template_fields:
            raise RequestError(400, f"a template may have at most {limits.max_template_fields} fields", param="text")
    if not fields:
        raise RequestError(400, "template has no {field} placeholders; register plain text as a skill", param="text")
    labels = {} if labels is None else labels
    if (not isinstance(labels, dict) or set(labels) - set(fields)
            or not all(isinstance(v, str) and v.strip() and len(v) <= limits.max_name_chars and _LABEL_RE.fullmatch(v)
                       for v in labels.values())):
        raise RequestError(400, "labels must map template fields to non-empty one-line names without braces, of at "
                                f"most {limits.max_name_chars} characters", param="labels")
    return tuple(fields), tuple(sorted(labels.items()))


class Registry:
    """Skills, memories and templates of each tenant, read from and written to the state store."""

    def __init__(self, state: StateStore):
        self.state = state

    def add_chunk(self, reg: Registration) -> None:
        self.state.put_registration(reg)

    def chunk(self, tenant: str, kind: str, name: str) -> Registration:
        r = self.state.get_registration(tenant, kind, name)
        if r is None:
            raise RequestError(404, f"unknown {kind} {name!r}; register it with POST /v1/{kind}s",
                               code=f"{kind}_not_found")
        return r

    def chunks(self, tenant: str, kind: str) -> list[Registration]:
        return self.state.list_registrations(tenant, kind)

    def remove_chunk(self, tenant: str, kind: str, name: str) -> Registration:
        r = self.chunk(tenant, kind, name)
        self.state.delete_registration(tenant, kind, name)
        return r

    def add_template(self, tenant: str, name: str, text, labels=None,
                     limits: RequestLimits | None = None) -> TemplateRecord:
        check_name(name, limits)
        fields, labels = parse_template(text, labels, limits)
        version = hashlib.sha256(f"{text}\0{labels}".encode()).hexdigest()[:16]
        t = TemplateRecord(tenant, name, text, fields, labels, version, time.time())
        self.state.put_template(t)
        return t

    def template(self, tenant: str, name: str) -> TemplateRecord:
        t = self.state.get_template(tenant, name)
        if t is None:
            raise RequestError(404, f"unknown template {name!r}; register it with POST /v1/templates",
                               code="template_not_found")
        return t

    def templates(self, tenant: str) -> list[TemplateRecord]:
        return self.state.list_templates(tenant)

    def remove_template(self, tenant: str, name: str) -> TemplateRecord:
        t = self.template(tenant, name)
        self.state.delete_template(tenant, name)
        return t
