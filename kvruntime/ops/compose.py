"""Composing a context from precompiled chunks: reposition, splice, seam repair.

``compose`` walks its segments through :class:`~kvruntime.ops.interpret.Interpreter`, the one
interpreter the prefill executor runs a plan's steps through as well.

A chunk is precompiled after a *prefix* whose slots are then dropped: by default the model's
BOS token alone (the anchor), so the chunk's slots sit at positions 1..n. (Without the anchor the
chunk's first token becomes an attention sink and, on Gemma-3, the splice fails outright.) Compiled after the prefix it will actually follow (the chat frame,
``kvruntime.ops.frame``), a chunk placed right after that prefix is exact reuse: ``compose``
splices it without rotation or seam repair.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvruntime.kv import KVCache
from kvruntime.ops.interpret import Interpreter, SeamRule, naive_splice  # noqa: F401 (re-exported)
from kvruntime.ops.slots import reposition, seam_repair, write_slots  # noqa: F401 (re-exported)


def default_prefix(engine) -> list[int]:
    """The anchor a chunk is compiled after when no prefix is given: [BOS], or nothing."""
    return [] if engine.bos_id is None else [engine.bos_id]


def precompile_chunk(engine, token_ids: list[int], prefix: list[int] | None = None) -> KVCache:
    """KV of ``token_ids`` compiled after ``prefix`` (default :func:`default_prefix`), whose slots
    are dropped: the chunk sits at positions m..m+n-1, m = len(prefix) (1..n after BOS).
    Cost: one prefill of m + n tokens, O((m + n)^2) attention."""
    if not token_ids:
        raise ValueError("cannot precompile an empty chunk")
    prefix = default_prefix(engine) if prefix is None else [int(t) for t in prefix]
    ids = [*prefix, *token_ids]
    kv = engine.prefill(ids, torch.arange(len(ids))).kv
    return kv.slice(len(prefix)) if prefix else kv


@dataclass(frozen=True)
class TextSegment:
    token_ids: list[int]     # computed in context (prefill against everything before it)


@dataclass(frozen=True)
class ChunkSegment:
    kv: KVCache              # precompiled at canonical positions (see precompile_chunk)
    prefix: tuple[int, ...] | None = None   # token ids it was compiled after; None = unknown / the anchor


@dataclass(frozen=True)
class ComposeResult:
    kv: KVCache                      # the composed context, slots in position order
    logits: torch.Tensor | None      # [vocab] after the last slot, if the last segment was text
    computed_tokens: int             # tokens that went through a forward pass
    reused_tokens: int               # chunk tokens taken from precompiled KV (minus seam tokens)
    chunk_starts: list[int] = field(default_factory=list)  # slot index where each chunk begins
    probed_tokens: int = 0           # selective recompute: chunk tokens run through the probe layers


def compose(engine, segments: list[TextSegment | ChunkSegment], *, seam_tokens: int = 1,
            rotate: bool = True, recompute_ratio: float = 0.0, probe: str = "kv1",
            probe_cache: dict | None = None) -> ComposeResult:
    """Build a context left to right: text is prefilled in context; a chunk is repositioned to
    the cursor (or naively spliced when ``rotate`` is False) and its first ``seam_tokens``
    recomputed. With ``recompute_ratio`` r > 0, before any text (and at the end) the run of
    chunks since the last text also gets :func:`~kvruntime.ops.blend.selective_recompute`: the
    r share of its tokens that deviate most is recomputed with the seams in one forward.
    Cost: O(text * P) + O(chunks * seam_tokens * P) forward work plus O(chunk tokens) rotation,
    plus (r > 0) a 2-layer probe and O(r * chunk tokens * P) forward, versus O(P^2) for recompute.
    ``probe`` picks the ranking (see :mod:`kvruntime.ops.blend`; ``q...`` probes rank by the text
    that follows, :mod:`kvruntime.ops.qselect`); ``probe_cache`` (a dict kept by the caller for one
    context) lets several ratios share one probe. A chunk whose ``prefix`` is exactly the context
    before it (``Interpreter.follows``, :mod:`kvruntime.ops.interpret`) is exact reuse: no
    rotation, seam or recompute."""
    from kvruntime.ops.blend import blend_count
    blend_count(recompute_ratio, 0)  # validates the ratio
    total = sum(len(s.token_ids) if isinstance(s, TextSegment) else s.kv.num_tokens for s in segments
                if isinstance(s, (TextSegment, ChunkSegment)))
    run = Interpreter(engine, total, probe_cache=probe_cache)      # the executor's interpreter too
    rule = SeamRule(seam_tokens, recompute_ratio, probe)
    logits, starts = None, []
    for seg in segments:
        if isinstance(seg, TextSegment):
            if seg.token_ids:
                logits = run.text(seg.token_ids, logits=True)      # after the pending seams' repair
        elif isinstance(seg, ChunkSegment) and seg.prefix is not None \
                and run.follows(seg.prefix, int(seg.kv.positions[0])):
            starts.append(run.length)                             # compiled after exactly this context
            run.splice(seg.kv)
            logits = None
        elif isinstance(seg, ChunkSegment):
            starts.append(run.chunk(seg.kv, rule, rotate=rotate))
            logits = None
        else:
            raise TypeError(f"unknown segment type {type(seg).__name__}")
    kv, t = run.finish(), run.tally
    return ComposeResult(kv, logits, t.computed, t.reused + t.repositioned, starts, run.probed)
