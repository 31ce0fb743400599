"""Document-like units of a prompt: what a RAG app, an agent framework or a person pastes as one
piece, found without any earlier prompt to compare with (pure: token ids and each id's text).

A unit is a block of a message's content between blank lines (a run of whitespace-only tokens
holding two line breaks or more), without the whitespace at its edges and without a short
numbered label it opens with (``[3] ``, ``Document 5:``, ``Source 2)``: a reranker numbers the
same passage differently in every request, so the passage after the label is what recurs). A
unit shorter than ``min_tokens`` is none. Under ``matching.compile_after: 1`` the units of a
prompt's first sighting are compiled on their own in the background (``cluster.control.recurring``),
so a document sent again in another request, at another offset or in another order, is found by
its anchors from its second sighting on.
"""
from __future__ import annotations

from typing import Callable

Text = Callable[[int], str]           # a token id's text (the tokenizer's decode of that one id)
LABEL_ENDS = ("]", ":", ")")          # a label closes with one of these


def blocks(ids, ranges: list[tuple[int, int]], text: Text) -> list[tuple[int, int]]:
    """(start, end) of the blank-line-separated blocks of ``ids[a:b]`` for each range, their edge
    whitespace left out (empty blocks dropped)."""
    out = []
    for a, b in ranges:
        start, i = a, a
        while i < b:
            if text(ids[i]).strip():
                i += 1
                continue
            j, breaks = i, 0
            while j < b and not text(ids[j]).strip():       # a run of whitespace-only tokens
                breaks += text(ids[j]).count("\n")
                j += 1
            if breaks >= 2:
                out.append((start, i))
                start = j
            i = j
        out.append((start, b))
    return [e for e in (_strip(ids, s, t, text) for s, t in out) if e[1] > e[0]]


def _strip(ids, start: int, end: int, text: Text) -> tuple[int, int]:
    while start < end and not text(ids[start]).strip():
        start += 1
    while end > start and not text(ids[end - 1]).strip():
        end -= 1
    return start, end


def label_end(ids, start: int, end: int, text: Text, most: int) -> int:
    """Where a block's content starts after a numbered label of at most ``most`` tokens (a digit
    in it, closed by one of :data:`LABEL_ENDS`, the whitespace after it skipped); ``start``
    when it opens with none."""
    digit = False
    for i in range(start, min(start + most, end)):
        t = text(ids[i])
        digit = digit or any(ch.isdigit() for ch in t)
        if digit and t.rstrip().endswith(LABEL_ENDS):
            return _strip(ids, i + 1, end, text)[0]
    return start


def units(ids, ranges: list[tuple[int, int]], text: Text, min_tokens: int, label_tokens: int) -> list[tuple[int, int]]:
    """The prompt's document-like units (module docstring), in prompt order."""
    out = []
    for s, e in blocks(ids, ranges, text):
        s = label_end(ids, s, e, text, label_tokens) if label_tokens else s
        if e - s >= min_tokens:
            out.append((s, e))
    return out


def content_ranges(messages: tuple, n: int) -> list[tuple[int, int]]:
    """Each message's content in a prompt of ``n`` tokens (``messages``: (index, role, first
    token, end) as the renderer gives them); the whole prompt when it names none (completions)."""
    got = [(max(0, a), min(n, b)) for _, _, a, b in messages if min(n, b) > max(0, a)]
    return got or [(0, n)]
