"""Matching a prompt's token ids against what the tenant's tier holds: the longest exact prefix
comes first (the prompt index, ``cluster.control.prompt_index``); this module finds the rest.

- **Chunks at any offset**: registered skills / memories and recurring spans compiled on their
  own (``cluster.control.recurring``), found by their anchors (``cluster.control.fingerprints``)
  and verified by the fingerprint of the ids found there. The prompt is then split into text
  segments and chunk segments (:func:`segments`), planned by the native rules.
- **Edits found, not declared**: the earlier prompt that shares the most span tokens with this
  one (each span's entry remembers the last prompt it was seen in and where), when equal to
  it but for one contiguous span short enough (:func:`find_edit`) and held in the tier, becomes
  a :class:`~cluster.control.planner.HeldPromptEdit`.

Pure functions over the entries one batched store read returned (``StateStore.get_fingerprints``);
:mod:`cluster.control.prompt_match` does the reads and the tier lookups.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from cluster.control.fingerprints import Cut, SpanConfig, anchors, as_ids, divergence, fingerprint
from cluster.control.planner import RenderedSegment
from kvruntime.config.matching import MatchConfig  # noqa: F401  (re-exported: the one MatchConfig)
from kvruntime.messages.plan import KVRef

ANCHOR = "c1|"       # an anchor key's data: "c1|<anchor end in the chunk>|<length>|<fingerprint>|<kind>|<name>"
SEP = "\n"           # between the chunks one anchor key names (a passage inside a document: both hold its windows)
CHUNKS_PER_ANCHOR = 4


@dataclass(frozen=True)
class ChunkMatch:
    start: int                      # token offset in the prompt
    end: int                        # exclusive
    kind: str                       # "skill" | "memory" | "span"
    name: str                       # the registration's name, or the span's fingerprint (12 hex)
    kv: KVRef                       # the chunk's KV at its canonical position


def lookup_keys(c: Cut) -> list[str]:
    """Every key one prompt's match reads: its spans (each one's count, and in its data the prompt
    it was last seen in), its anchors."""
    return [s.key for s in c.spans] + list(c.anchor_keys)


def anchor_entries(kind: str, name: str, tenant: str, ids: tuple[int, ...], cfg: SpanConfig) -> dict[str, str]:
    """The anchor keys of a chunk (a registration, or a recurring span compiled on its own), each
    naming the chunk, the anchor's end offset in it, its length and its fingerprint."""
    fp = fingerprint(tenant, ids)
    return {a.key: f"{ANCHOR}{a.end}|{len(ids)}|{fp}|{kind}|{name}" for a in anchors(tenant, ids, cfg)}


def anchored_chunks(tenant: str, ids: tuple[int, ...], c: Cut, entries: dict,
                    chunk_ref: Callable[[tuple[int, ...]], KVRef], start_at: int, arr=None) -> list[ChunkMatch]:
    """Chunks whose ids appear in ``ids`` at or after ``start_at``: found by an anchor, verified
    by the fingerprint of the ids there (a re-registered chunk's old anchors no longer match).
    ``arr``: ``ids`` as an int64 array, when the caller has it."""
    arr = as_ids(ids) if arr is None else arr
    out, seen = [], set()
    for end, key in zip(c.anchor_ends, c.anchor_keys):
        for one in anchor_data(entries.get(key)):
            off, n, fp, kind, name = one[len(ANCHOR):].split("|", 4)
            start, n = end - int(off), int(n)
            if (fp, start) in seen or start < start_at or start + n > len(ids):
                continue
            seen.add((fp, start))
            if fingerprint(tenant, arr[start:start + n]) == fp:
                out.append(ChunkMatch(start, start + n, kind, name, chunk_ref(tuple(ids[start:start + n]))))
    return out


def anchor_data(got) -> list[str]:
    """The chunk entries of one anchor key's stored ``(count, data)`` (none for a span key or None)."""
    return [e for e in got[1].split(SEP) if e.startswith(ANCHOR)] if got is not None else []


def _fp_of(entry: str) -> str:
    return entry.split("|", 4)[3]


def add_anchors(old: dict, new: dict[str, str]) -> dict[str, str]:
    """The anchor entries to write for a chunk (``new``: :func:`anchor_entries`), each key naming
    it first and then the other chunks it named before (``old``: the stored entries of those
    keys), at most :data:`CHUNKS_PER_ANCHOR`: a chunk whose windows another holds too (a passage
    quoted inside a document) stays findable by them."""
    out = {}
    for k, v in new.items():
        rest = [e for e in anchor_data(old.get(k)) if _fp_of(e) != _fp_of(v)]
        out[k] = SEP.join([v] + rest[:CHUNKS_PER_ANCHOR - 1])
    return out


def drop_anchors(old: dict, fp: str) -> tuple[dict[str, str], list[str]]:
    """A chunk (fingerprint ``fp``) taken off the stored anchor entries ``old``: (the keys to write
    with the other chunks they name, the keys that name no chunk any more)."""
    keep, gone = {}, []
    for k, got in old.items():
        rest = [e for e in anchor_data(got) if _fp_of(e) != fp]
        if rest:
            keep[k] = SEP.join(rest)
        else:
            gone.append(k)
    return keep, gone


def choose(matches: list[ChunkMatch], min_tokens: int) -> list[ChunkMatch]:
    """Non-overlapping matches, in prompt order: registrations before spans, longer first."""
    taken: list[ChunkMatch] = []
    for m in sorted(matches, key=lambda m: (m.kind == "span", -(m.end - m.start), m.start)):
        if m.end - m.start >= min_tokens and all(m.end <= t.start or m.start >= t.end for t in taken):
            taken.append(m)
    return sorted(taken, key=lambda m: m.start)


def segments(ids: tuple[int, ...], hit: int, chunks: list[ChunkMatch]) -> tuple[RenderedSegment, ...]:
    """The prompt as segments: the exact prefix (``prompt``, reused through the prompt index),
    then text and the matched chunks (skill / memory / span, each with its KVRef)."""
    out = [RenderedSegment("prompt", None, tuple(ids[:hit]))] if hit else []
    pos = hit
    for m in chunks:
        if m.start > pos:
            out.append(RenderedSegment("text", None, tuple(ids[pos:m.start])))
        out.append(RenderedSegment(m.kind, m.name, tuple(ids[m.start:m.end]), kv=m.kv))
        pos = m.end
    if pos < len(ids):
        out.append(RenderedSegment("text", None, tuple(ids[pos:])))
    return tuple(out)


def seen_in(data: str) -> tuple[str, int] | None:
    """A span entry's data (``"<prompt key>@<offset>"``): (the prompt it was last seen in, the
    span's offset there); None for a span counted but seen nowhere kept."""
    key, _, off = data.rpartition("@")
    return (key, int(off)) if key and off.isdigit() else None


def last_seen(entries: dict, span_key: str) -> tuple[str, int] | None:
    """Where the span ``span_key`` was last seen, from the entries a match read."""
    got = entries.get(span_key)
    return seen_in(got[1]) if got is not None else None


def nearest_held(c: Cut, entries: dict, exclude: str = "", max_shift: int | None = None) -> str | None:
    """The earlier prompt most of this prompt's spans were last seen in (its prompt-index key).
    ``max_shift``: count only spans seen there within this many tokens of their offset here (a
    prompt one span away from this one holds its equal parts at the same offsets, or shifted by
    the span's change in length: a prompt sharing text at another offset is no edit candidate)."""
    votes = Counter()
    for s in c.spans:
        got = last_seen(entries, s.key)
        if got is not None and got[0] != exclude and (max_shift is None or abs(got[1] - s.start) <= max_shift):
            votes[got[0]] += s.tokens
    return votes.most_common(1)[0][0] if votes else None


@dataclass(frozen=True)
class FoundEdit:
    start: int                      # first divergent token
    held_end: int                   # the held prompt realigns here
    new_end: int                    # and the new prompt here
    equal: int                      # tokens equal to the held prompt (prefix + tail)


def find_edit(new: tuple[int, ...], held: tuple[int, ...], cfg: MatchConfig) -> FoundEdit | None:
    """``new`` as ``held`` with one contiguous span replaced, when enough of it is equal
    (``edit_min_share``) and the divergent span is short enough; None otherwise (and for two
    equal prompts, or one that only extends the held one: the prompt index serves those)."""
    if not may_edit(new, held, cfg.edit_max_tokens):
        return None
    p, s = divergence(new, held)
    new_end, held_end = len(new) - s, len(held) - s
    if (new_end == p and held_end == p) or (s == 0 and p in (new_end, held_end)):
        return None                 # equal, or one only extends the other: an exact prefix
    if p + s < cfg.edit_min_share * len(new) or max(new_end, held_end) - p > cfg.edit_max_tokens:
        return None
    return FoundEdit(p, held_end, new_end, p + s)


def may_edit(new, held, most: int) -> bool:
    """A quick necessary condition for ``new`` being ``held`` with one span of at most ``most``
    tokens replaced, from every ``most + 1``-th token (at most one of them falls in the span):
    the lengths differ by at most ``most``, and the samples equal ``held`` at their own offset up
    to the first that does not, and at their offset shifted by the change in length after it."""
    d = len(new) - len(held)
    if abs(d) > most:
        return False
    step = most + 1
    k = next((i for i in range(0, len(new), step) if i >= len(held) or new[i] != held[i]), None)
    return k is None or all(0 <= i - d < len(held) and new[i] == held[i - d] for i in range(k + step, len(new), step))


def where(offset: int, messages: tuple[tuple[int, str, int, int], ...]) -> str:
    """A token offset in words: ``"message 2 (user), token 812"`` (``messages``: (index, role,
    first token, end) of each message's content in the prompt; empty: the offset alone)."""
    for i, role, start, end in messages:
        if start <= offset < end:
            return f"message {i} ({role}), token {offset}"
    before = [m for m in messages if m[2] <= offset]
    if before:
        i, role = before[-1][:2]
        return f"after message {i} ({role}), token {offset} (chat markup)"
    return f"token {offset}"
