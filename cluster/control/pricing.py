"""Pricing a request before (and while) it is tokenised, so a body whose text cannot fit the
context window is refused without paying for its tokens.

The bound: every token of the model's tokenizer stands for at most ``max_chars`` characters of
the text it came from (the longest vocabulary piece, computed once at start by
:func:`max_token_chars`), so a text of ``C`` characters is at least ``ceil(C / max_chars)``
tokens. That holds when the tokenizer never drops or merges input characters before its
model runs: byte-level BPE (each piece is a run of UTF-8 bytes, at least one per character)
and SentencePiece-style BPE (``' ' -> '▁'``, byte fallback) both qualify; a normalizer or
pre-tokenizer that may shrink the text (Unicode normalization, whitespace splitting, regex
replacement) makes :func:`max_token_chars` return None and only the exact count applies.

:class:`TokenBudget` then follows tokenisation segment by segment and refuses as soon as the
running total (or the running total plus the next segment's lower bound) exceeds the window,
with the same 400 ``context_length_exceeded`` as the exact check in the router.
"""
from __future__ import annotations

import json
import logging
import math

from cluster.control.errors import RequestError

log = logging.getLogger(__name__)

# normalizers / pre-tokenizers that keep every input character (or only add some)
_KEEPING_NORMALIZERS = {"Prepend"}
_KEEPING_PRETOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _keeps_characters(part: dict | None, allowed: set[str]) -> bool:
    """True when a normalizer / pre-tokenizer section of ``tokenizer.json`` cannot make the text
    shorter (a Sequence qualifies when every member does)."""
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        members = part.get("normalizers", part.get("pretokenizers", []))
        return all(_keeps_characters(p, allowed) for p in members)
    if kind == "Replace":              # a plain string replaced by one at least as long
        pat = (part.get("pattern") or {}).get("String")
        return isinstance(pat, str) and len(part.get("content", "")) >= len(pat) > 0
    if kind in ("Split", "Punctuation"):
        return part.get("behavior") != "Removed"
    return kind in allowed


def max_token_chars(tokenizer) -> int | None:
    """The most characters of input text one token can stand for (longest vocabulary piece or
    added token), or None when this tokenizer may drop or merge characters (then no character
    bound is claimed). Takes well under a second for a 262k vocabulary; call it once."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        log.warning("tokenizer %s has no fast backend: requests are priced by exact token counts only",
                    type(tokenizer).__name__)
        return None
    spec = json.loads(backend.to_str())
    if not (_keeps_characters(spec.get("normalizer"), _KEEPING_NORMALIZERS)
            and _keeps_characters(spec.get("pre_tokenizer"), _KEEPING_PRETOKENIZERS)
            and spec.get("model", {}).get("type") in ("BPE", "Unigram", "WordPiece")):
        log.warning("tokenizer normalizer/pre-tokenizer may shrink text (%s / %s): requests are priced by "
                    "exact token counts only", (spec.get("normalizer") or {}).get("type"),
                    (spec.get("pre_tokenizer") or {}).get("type"))
        return None
    pieces = list(backend.get_vocab(with_added_tokens=True))
    longest = max((len(p) for p in pieces), default=0)
    # WordPiece continuation pieces ("##ab") stand for fewer characters than they spell: still a bound
    return max(longest, 1)


def exceeds_message(prompt: str, max_tokens: int, window: int) -> str:
    return (f"prompt ({prompt}) + max_tokens ({max_tokens}) exceeds the model's context window of "
            f"{window} tokens")


class TokenBudget:
    """The prompt tokens a request may still spend: ``window - max_tokens``. Not thread-safe: one
    per request, used by the one thread that tokenises it."""

    def __init__(self, window: int, max_tokens: int, max_chars: int | None):
        self.window, self.max_tokens, self.max_chars = window, max_tokens, max_chars
        self.limit = window - max_tokens
        self.used = 0                      # exact tokens of the pieces tokenised so far

    def _refuse(self, prompt: str) -> RequestError:
        return RequestError(400, exceeds_message(prompt, self.max_tokens, self.window),
                            code="context_length_exceeded")

    def lower_bound(self, chars: int) -> int:
        """Fewest tokens a text of ``chars`` characters can be (0 without a character bound)."""
        return math.ceil(chars / self.max_chars) if self.max_chars else 0

    def price_chars(self, chars: int) -> None:
        """Before tokenising ``chars`` more characters: refuse when even their fewest tokens do
        not fit beside what is already counted."""
        low = self.lower_bound(chars)
        if self.used + low > self.limit:
            raise self._refuse(f"at least {self.used + low} tokens: {chars} characters of text, at most "
                               f"{self.max_chars} characters per token")

    def charge(self, tokens: int) -> None:
        """After tokenising a piece: refuse as soon as the running total no longer fits."""
        self.used += tokens
        if self.used > self.limit:
            raise self._refuse(f"at least {self.used} tokens")

    def encode(self, encode, text: str) -> list[int]:
        """``encode(text)`` priced first by its characters, then charged by its tokens."""
        self.price_chars(len(text))
        ids = encode(text)
        self.charge(len(ids))
        return ids
