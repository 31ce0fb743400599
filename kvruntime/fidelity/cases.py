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
    prelude: str = ""         # text computed in context between the frame and the first chunk
    kind: str = "compose"     # "compose" | "decision" (yes/no: answers == ("yes",) or ("no",))


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


# ---- yes/no decision cases (the seed paper's E2, re-created from templates) -------------------
# A user memory of account settings is placed late, after a conversation; a yes/no question's
# answer depends on two of the settings (proceed only if both are enabled). Generated
# deterministically (random.Random seeded by the case number), half "yes", half "no".
_SETTINGS = (
    ("marketing emails", "promotional email campaigns"), ("push alerts", "mobile push notifications"),
    ("SMS updates", "text-message status updates"), ("data sharing", "usage data shared with partners"),
    ("personalized ads", "ads tailored from activity"), ("location history", "precise location kept"),
    ("third-party export", "records exported to other tools"), ("two-factor login", "a second login step"),
    ("new-device approval", "logins from new devices approved automatically"),
    ("auto-renew", "the subscription renews automatically"), ("saved cards", "card kept for one-click pay"),
    ("overdraft purchases", "purchases allowed past the balance"), ("public profile", "profile visible to anyone"),
    ("contact sync", "phone contacts synced to the service"), ("beta features", "experimental features on"),
    ("auto-reply", "automatic replies when away"), ("cloud backup", "encrypted backups in the cloud"),
    ("calendar access", "calendar shared with the assistant"), ("newsletter", "the weekly product newsletter"),
    ("activity status", "online status shown to others"),
)
_ACTIONS = (
    ("send the user a promotional offer", ("marketing emails", "personalized ads")),
    ("share the user's order history with a partner", ("data sharing", "third-party export")),
    ("charge the saved card for next year's plan", ("auto-renew", "saved cards")),
    ("post the user's new badge on their profile", ("public profile", "activity status")),
    ("copy the user's contacts into the new address book", ("contact sync", "cloud backup")),
    ("enroll the user in the new scheduling beta", ("beta features", "calendar access")),
    ("text the user a delivery alert", ("SMS updates", "push alerts")),
    ("let a login from a new laptop through", ("new-device approval", "two-factor login")),
)
_TOPICS = ("the weather this week", "a recipe for dinner", "weekend plans", "a film to watch",
           "staying focused at work", "a short trip by train", "a book to read", "sleeping better",
           "a simple workout", "music for studying")
DECISION_CASES = 40
DECISION_SETTINGS = 14


def _decision(i: int) -> tuple[ComposeCase, str, str]:
    import random
    rng = random.Random(f"kvnotes-e2-{i}")
    action, relevant = _ACTIONS[i % len(_ACTIONS)]
    others = [s for s in _SETTINGS if s[0] not in relevant]
    rng.shuffle(others)
    settings = [s for s in _SETTINGS if s[0] in relevant] + others[: DECISION_SETTINGS - len(relevant)]
    rng.shuffle(settings)
    state = {name: rng.random() < 0.6 for name, _ in settings}
    gold_yes = i % 2 == 0
    for name in relevant:
        state[name] = True
    if not gold_yes:
        state[relevant[(i // 2) % 2]] = False        # exactly one of the two disabled
    memory = "User memory (account settings):\n" + "\n".join(
        f"- {name}: {'enabled' if state[name] else 'disabled'} ({note})" for name, note in settings)
    turns = []
    for _ in range(3):
        topic = rng.choice(_TOPICS)
        turns += [f"User: Can we talk about {topic}?",
                  f"Assistant: Sure, here are a few light thoughts about {topic}, nothing to do with your account."]
    prelude = "Earlier conversation:\n" + "\n".join(turns) + "\n\n"
    question = (f"The assistant wants to {action}. Rule: proceed only if both {relevant[0]} and "
                f"{relevant[1]} are enabled in the user memory above. Should the assistant proceed? "
                f"Answer yes or no.")
    pid = f"e2-mem-{i:03d}"
    return ComposeCase(f"d{i:03d}", (pid,), question, ("yes" if gold_yes else "no",), prelude, "decision"), pid, memory


def load_decision_cases(n: int = DECISION_CASES) -> tuple[list[ComposeCase], dict[str, str]]:
    """``n`` yes/no decision cases and their memory passages (id -> text); deterministic."""
    if n <= 0:
        raise ValueError("need at least one decision case")
    cases, passages = [], {}
    for i in range(n):
        case, pid, text = _decision(i)
        cases.append(case)
        passages[pid] = text
    return cases, passages
