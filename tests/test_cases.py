"""The shipped fidelity case set keeps the shape the harness (and docs/fidelity.md) relies on."""
import re
from collections import Counter

from kvruntime.fidelity.cases import load_compose_cases, load_edit_cases, load_passages, split_template


def test_compose_cases():
    passages, cases = load_passages(), load_compose_cases()
    assert len(cases) >= 60 and len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert 2 <= len(c.chunks) <= 4 and all(p in passages for p in c.chunks), c.id
        assert c.question.strip()
    assert {len(c.chunks) for c in cases} == {2, 3, 4}


def test_edit_cases():
    cases = load_edit_cases()
    assert len(cases) >= 60 and len({c.id for c in cases}) == len(cases)
    assert set(Counter(c.kind for c in cases)) == {"lookup", "derived"}
    assert set(Counter(c.category for c in cases)) == {"price", "date", "status", "name", "number"}
    for c in cases:
        before, after = split_template(c)                       # field appears exactly once
        assert c.fields[c.field] == c.old != c.new, c.id
        leak = re.search(rf"(?<![\w.:]){re.escape(c.old)}(?![\w:])", before + after)
        assert leak is None or c.kind == "derived", c.id        # lookups do not leak the old value
