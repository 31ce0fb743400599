"""The shipped case sets, loaded into frozen values and tokenized per model."""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class ComposeCase:
    id: str
    chunks: tuple[str, ...]   # passage ids, in context order
    question: str
    answers: tuple[str, ...] = ()   # accepted answers (any one, case-insensitive); () = not judged


@dataclass(frozen=True)
class EditCase:
    id: str
    template: str             # str.format template with {placeholders}
    fields: dict              # placeholder -> value (fields[field] == old)
    field: str                # the placeholder that changes
    old: str
    new: str
    label: str                # human name of the field, used in errata
    question: str
    kind: str                 # "lookup" | "derived"
    category: str             # price | date | status | name | number


def _evalsets():
    return resources.files("kvruntime") / "evalsets"


def load_passages() -> dict[str, str]:
    return json.loads((_evalsets() / "passages.json").read_text())


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (_evalsets() / name).read_text().splitlines() if line.strip()]


def load_compose_cases() -> list[ComposeCase]:
    return [ComposeCase(d["id"], tuple(d["chunks"]), d["question"], tuple(d.get("answer", ())))
            for d in _jsonl("compose.jsonl")]


def load_edit_cases() -> list[EditCase]:
    keys = EditCase.__dataclass_fields__
    return [EditCase(**{k: d[k] for k in keys}) for d in _jsonl("edit.jsonl")]


def split_template(case: EditCase) -> tuple[str, str]:
    """Render the template around the edited field: (text before it, text after it)."""
    marker = "\x00FIELD\x00"
    names = {f for _, f, _, _ in string.Formatter().parse(case.template) if f}
    if case.field not in names:
        raise ValueError(f"case {case.id}: field {case.field!r} not in template")
    values = {**case.fields, case.field: marker}
    rendered = case.template.format(**values)
    if rendered.count(marker) != 1:
        raise ValueError(f"case {case.id}: field {case.field!r} must appear exactly once")
    before, after = rendered.split(marker)
    return before, after
