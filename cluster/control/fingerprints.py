"""Content-defined spans and fingerprints of token ids: the pure half of prompt matching.

A rolling hash over a window of ``window`` token ids marks a *candidate* boundary after token
``i`` when its top ``boundary_bits`` bits are zero; the spans of a prompt cut at candidates at
least ``min_span`` tokens after the last cut (and, with none within ``max_span``, at the window
of least hash in that range: :func:`cuts`). A
boundary depends only on the ``window`` ids before it, so two prompts holding the same text at
different offsets (after an insertion, a reorder, an edited field) cut it into the same spans
once their cuts meet again: the matcher finds them by the span's fingerprint.

*Anchors* are the windows whose top ``anchor_bits`` bits are zero, with no length rule: a
registered skill or memory is found at any offset of a prompt by the anchors inside it (each
anchor names the chunk and its offset in it; the match is verified on the ids).

Fingerprints are tenant-scoped (the tenant is hashed in), 32 hex characters; keys carry a kind
prefix (``s:`` a span: its count is how many kept prompts held it, its data the prompt it was
last seen in and where; ``a:`` an anchor) and live in the state store
(``StateStore.get_fingerprints``). numpy only, no I/O: an 8k-token prompt is cut and
fingerprinted in well under a millisecond. ``SpanConfig`` lives in :mod:`kvruntime.config.matching`.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

import numpy as np

from kvruntime.config.matching import SpanConfig  # noqa: F401  (re-exported: the one SpanConfig)

_MIX = np.uint64(0x9E3779B97F4A7C15)        # odd constants: each id is spread over 64 bits
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_BASE = np.uint64(0x100000001B3)


@dataclass(frozen=True)
class Span:
    start: int                  # token offset in the prompt (inclusive)
    end: int                    # exclusive
    key: str                    # "s:" + fingerprint of ids[start:end]
    bounded: bool               # its end is a content-defined cut (False: the prompt's end)

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Anchor:
    end: int                    # the anchor window is ids[end - window:end]
    key: str                    # "a:" + tenant-scoped hash of the window


def window_hashes(ids, window: int) -> np.ndarray:
    """``h[j]``: the hash of ``ids[j:j + window]`` (uint64), for ``j`` in ``0..n - window``."""
    a = as_ids(ids).astype(np.uint64)
    n = len(a)
    if n < window:
        return np.zeros(0, dtype=np.uint64)
    x = (a + np.uint64(1)) * _MIX
    x ^= x >> np.uint64(31)
    x *= _MIX2
    h = np.zeros(n - window + 1, dtype=np.uint64)
    for j in range(window):                  # sum of x[i + j] * BASE**(window-1-j), wrapping
        h *= _BASE
        h += x[j:n - window + 1 + j]
    h ^= h >> np.uint64(29)
    h *= _MIX
    return h


def _top_zero(h: np.ndarray, bits: int) -> np.ndarray:
    return np.flatnonzero((h >> np.uint64(64 - bits)) == 0)


def cuts(ids, cfg: SpanConfig = SpanConfig(), h: np.ndarray | None = None) -> list[int]:
    """Span ends (exclusive offsets) of ``ids``, the last one ``len(ids)``. A span ends at the
    first candidate at least ``min_span`` tokens after the last cut; where none comes within
    ``max_span`` tokens (templated text: lines differing only in a few numbers repeat the same
    windows, none of them a candidate), at the window with the least hash among the allowed ends
    (the first such): content-anchored too, so two prompts holding the text from different starts
    cut it at the same places once their allowed ranges share that minimum (a cut at a fixed
    ``max_span`` from the last one would never realign)."""
    n = len(ids)
    h = window_hashes(ids, cfg.window) if h is None else h
    cand = _top_zero(h, cfg.boundary_bits) + cfg.window                # a cut after the window's last id
    out, last, i = [], 0, 0
    while n - last > cfg.min_span:
        i += int(np.searchsorted(cand[i:], last + cfg.min_span))     # the first candidate allowed
        if i < len(cand) and cand[i] <= last + cfg.max_span and cand[i] < n:
            last = int(cand[i])
        elif n - last > cfg.max_span:                                  # none within max_span: the least hash
            lo = last + cfg.min_span - cfg.window                     # h[j] ends a cut at j + window
            last = lo + int(np.argmin(h[lo:last + cfg.max_span - cfg.window + 1])) + cfg.window
        else:
            break
        out.append(last)
    if n > last:
        out.append(n)
    return out


def fingerprint(tenant: str, ids) -> str:
    """Tenant-scoped content hash of ``ids`` (32 hex characters)."""
    return _fp(tenant.encode()[:64], as_ids(ids).tobytes())


def _fp(key: bytes, raw) -> str:
    return hashlib.blake2b(raw, digest_size=16, person=b"kvnotes-span", key=key).hexdigest()


def _hasher(key: bytes):
    return hashlib.blake2b(digest_size=16, person=b"kvnotes-span", key=key)


def spans(tenant: str, ids, cfg: SpanConfig = SpanConfig(), h: np.ndarray | None = None) -> list[Span]:
    """The content-defined spans of ``ids`` with their fingerprints."""
    arr = as_ids(ids)
    raw, base = memoryview(arr.tobytes()), _hasher(tenant.encode()[:64])
    out, start, n = [], 0, len(arr)
    for end in cuts(arr, cfg, h):
        one = base.copy()                   # the keyed state, copied: cheaper than keying each span again
        one.update(raw[start * 8:end * 8])
        out.append(Span(start, end, "s:" + one.hexdigest(), end < n))
        start = end
    return out


def anchors(tenant: str, ids, cfg: SpanConfig = SpanConfig(), h: np.ndarray | None = None) -> list[Anchor]:
    """The anchors of ``ids``: windows whose hash has ``anchor_bits`` leading zero bits. The key
    hashes the 64-bit window hash with the tenant (collisions are caught by verifying ids)."""
    ends, keys = _anchor_keys(tenant, window_hashes(ids, cfg.window) if h is None else h, cfg)
    return [Anchor(e, k) for e, k in zip(ends, keys)]


def _anchor_keys(tenant: str, h: np.ndarray, cfg: SpanConfig) -> tuple[list[int], list[str]]:
    """(end offsets, keys) of the anchors among the window hashes ``h``, without an object each."""
    prefix = "a:" + hashlib.blake2b(tenant.encode(), digest_size=8, person=b"kvnotes-anchor").hexdigest()
    at = _top_zero(h, cfg.anchor_bits)
    hexed = h[at].astype(">u8").tobytes().hex()       # each window hash as 16 hex digits, in one pass
    return (at + cfg.window).tolist(), [prefix + hexed[i:i + 16] for i in range(0, len(hexed), 16)]


@dataclass(frozen=True)
class Cut:
    """A prompt, cut: its spans and anchors from one pass of the rolling hash (the anchors kept
    as two parallel tuples: a prompt has hundreds, read by key)."""
    spans: tuple[Span, ...]
    anchor_ends: tuple[int, ...]
    anchor_keys: tuple[str, ...]

    @property
    def anchors(self) -> tuple[Anchor, ...]:
        return tuple(Anchor(e, k) for e, k in zip(self.anchor_ends, self.anchor_keys))


def as_ids(ids) -> np.ndarray:
    """Token ids as an int64 array (a tuple of ints converted through a typed buffer: faster than
    ``np.asarray`` on a tuple; an array as it is)."""
    if isinstance(ids, np.ndarray):
        return ids if ids.dtype == np.int64 else ids.astype(np.int64)
    return np.frombuffer(array("q", ids), dtype=np.int64)


def cut(tenant: str, ids, cfg: SpanConfig = SpanConfig()) -> Cut:
    arr = as_ids(ids)
    h = window_hashes(arr, cfg.window)
    ends, keys = _anchor_keys(tenant, h, cfg)
    return Cut(tuple(spans(tenant, arr, cfg, h)), tuple(ends), tuple(keys))


def divergence(new, held) -> tuple[int, int]:
    """(common prefix length, common suffix length) of two id sequences, the suffix never
    overlapping the prefix in either: ``new`` equals ``held`` except ``new[p:len(new)-s]``
    replacing ``held[p:len(held)-s]``."""
    a, b = as_ids(new), as_ids(held)
    m = min(len(a), len(b))
    neq = np.flatnonzero(a[:m] != b[:m])
    p = int(neq[0]) if len(neq) else m
    room = m - p
    if room == 0:
        return p, 0
    ra, rb = a[len(a) - room:][::-1], b[len(b) - room:][::-1]
    neq = np.flatnonzero(ra != rb)
    return p, int(neq[0]) if len(neq) else room
