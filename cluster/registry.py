"""Named context per tenant -- skills, memories, templates -- kept in the state store, so every
router replica sees the same registrations and a restart loses none. Validation of names and
template text lives here; the KV itself is addressed by content (``KVRef``), never by name."""
from __future__ import annotations

import hashlib
import string
import time

from cluster.errors import RequestError
from cluster.state import Registration, StateStore, TemplateRecord

MAX_NAME = 128


def check_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
        raise RequestError(400, f"name must be a non-empty string of at most {MAX_NAME} characters", param="name")
    return name


def parse_template(text, labels) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(fields in order, labels) of a ``{field}`` template; ``RequestError`` 400 when invalid."""
    if not isinstance(text, str) or not text.strip():
        raise RequestError(400, "template text must be a non-empty string", param="text")
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise RequestError(400, f"template text is not a valid {{field}} template: {exc}", param="text") from None
    fields: list[str] = []
    for _, f, spec, conv in parsed:
        if f is None:
            continue
        if not f.isidentifier() or spec or conv:
            raise RequestError(400, f"template placeholder {{{f}}} must be a plain identifier", param="text")
        if f in fields:
            raise RequestError(400, f"template placeholder {{{f}}} appears twice; each field must appear once",
                               param="text")
        fields.append(f)
    if not fields:
        raise RequestError(400, "template has no {field} placeholders; register plain text as a skill", param="text")
    labels = {} if labels is None else labels
    if (not isinstance(labels, dict) or set(labels) - set(fields)
            or not all(isinstance(v, str) and v.strip() and len(v) <= MAX_NAME for v in labels.values())):
        raise RequestError(400, "labels must map template fields to non-empty human-readable names", param="labels")
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

    def add_template(self, tenant: str, name: str, text, labels=None) -> TemplateRecord:
        check_name(name)
        fields, labels = parse_template(text, labels)
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
