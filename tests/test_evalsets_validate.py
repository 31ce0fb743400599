"""The eval-set validator's stages (``kvruntime/evalsets/validate.py``), each on its own: the shipped
sets pass every check that needs no tokenizer, and each kind of broken case is named in one line."""
from __future__ import annotations

import json

from kvruntime.evalsets import validate as v


def _passage(n_words: int = 100) -> str:
    return " ".join(["word"] * n_words)


def test_the_shipped_sets_pass_the_schema_stages():
    out = v.Problems()
    passages = v.check_passages(json.loads(v.PASSAGES.read_text(encoding="utf-8")), out)
    compose = v.load_jsonl(v.COMPOSE, out)
    hist = v.check_compose(compose, passages, out)
    tally = v.check_edits(v.load_jsonl(v.EDIT, out), out)
    assert out == []
    assert sum(hist.values()) == len(compose) >= v.MIN_COMPOSE
    assert len(tally.rendered) >= v.MIN_EDIT and set(tally.kinds) == set(v.KINDS)


def test_broken_passages_and_compose_cases_are_each_named():
    out = v.Problems()
    passages = v.check_passages({"ok-one": _passage(), "Bad_Id": _passage(), "short": "a b", "brace": _passage() + "{"},
                                out)
    assert any("id 'Bad_Id' is not lowercase-hyphenated" in p for p in out)
    assert any("short: 2 words, outside 80-600" in p for p in out)
    assert any("brace: contains a brace" in p for p in out)
    assert any(f"4 passages, need at least {v.MIN_PASSAGES}" in p for p in out)
    out.clear()
    cases = [{"id": "c1", "chunks": ["ok-one", "nope"], "question": "Why?"},
             {"id": "c1", "chunks": ["ok-one"], "question": "no mark"},
             {"id": "c3", "chunks": ["ok-one", "short"], "question": "What?", "answer": ["absent"]}]
    hist = v.check_compose(cases, passages, out)
    assert hist == {2: 2, 1: 1}
    for msg in ("c1: unknown passage id 'nope'", "duplicate id c1", "c1: 1 chunks, need 2-4",
                "c1: question missing or has no question mark", "c3: no accepted answer appears in any of its chunks"):
        assert any(msg in p for p in out), (msg, out)


def test_broken_edit_cases_are_each_named_and_only_valid_ones_are_rendered():
    tpl = "{name} " + _passage(130)
    good = {"id": "e1", "template": tpl, "fields": {"name": "Lena"}, "field": "name", "old": "Lena", "new": "Mia",
            "label": "who", "question": "Who?", "kind": "lookup", "category": "name"}
    cases = [good,
             {**good, "id": "e2", "old": "Ada"},                                  # not the field's value
             {**good, "id": "e3", "new": "Lena"},                                 # no change
             {**good, "id": "e4", "template": "{name} {name} " + _passage(130)},  # the field twice
             {**good, "id": "e5", "template": "{name!r} x"},                      # a conversion
             {**good, "id": "e6", "kind": "guess", "category": "colour"},
             {"id": "e7", "template": tpl}]                                       # keys missing
    out = v.Problems()
    tally = v.check_edits(cases, out)
    for msg in ("e2: old 'Ada' != fields['name'] 'Lena'", "e3: old and new are the same ('Lena')",
                "e4: edited field {name} appears 2 times, need exactly 1", "e5: placeholder {name} has a format spec",
                "e6: kind 'guess' not in", "e6: category 'colour' not in", "e7: missing keys",
                f"category 'price' has 0 cases, need at least {v.MIN_PER_CATEGORY}"):
        assert any(msg in p for p in out), (msg, out)
    assert [r[0] for r in tally.rendered] == ["e1", "e2", "e3", "e4", "e6"]
    assert tally.rendered[0][1].startswith("Lena ") and tally.rendered[0][2].startswith("Mia ")


def test_token_budgets_are_checked_with_the_given_counter():
    out = v.Problems()
    passages = {"a": _passage(100), "b": _passage(900)}
    toks = v.check_tokens(lambda text: len(text.split()), passages, [{"id": "c", "chunks": ["a", "b"]}],
                          [("e", _passage(10), _passage(800))], out)
    assert toks.passages == {"a": 100, "b": 900} and toks.compose == [1000] and toks.edits == [10]
    assert out == ["passages.json: b: 900 tokens, outside 80-800",
                   "edit.jsonl: e: rendered template is 800 tokens, over 700"]
    assert v.report(passages, [], {}, [], v.EditTally(), toks, out) == 1
