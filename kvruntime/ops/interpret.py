"""The one interpreter of a context's KV steps over the :class:`~kvruntime.ops.build.Builder`.

Both ways a context is built walk their steps through ONE :class:`Interpreter`:
``kvruntime.ops.compose.compose`` (segments: the fidelity harness, ``kvnotes calibrate``, the
demo, the benches) and the prefill executor (``prefill_workers.steps``: a plan's steps, what is
served). So what is calibrated is what is served, and the rules live here once:

- **flush before text**: a write that is not a repositioned chunk (text run in context, loaded
  KV spliced, an edited context) first repairs the pending chunks' seams (and runs their
  selective recompute), so it sees repaired seams;
- **seam accounting**: a repositioned chunk's first ``tokens`` slots count as computed, the rest
  as repositioned; the selective recompute's extra tokens move from repositioned to computed;
- **the exact-follow check** (:func:`exactly_after`): KV compiled after exactly the context
  built so far is exact where it stands (spliced, no rotation, no seam).

An :class:`Interpreter` is made per build and dropped with it: nothing about a build is kept
on a long-lived object, so an executor can run builds concurrently.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from kvruntime.kv import KVCache
from kvruntime.ops.build import Builder
from kvruntime.ops.probes import is_question_probe
from kvruntime.telemetry import log_fallback_once

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeamRule:
    """How a repositioned chunk is repaired: its first ``tokens`` slots recomputed in context;
    with ``ratio`` > 0 also the top ``ratio`` share of the run of chunks' tokens, ranked by
    ``probe`` (``kv<N>``/``progressive``: ``ops.blend``; ``q...``: ``ops.qselect``)."""
    tokens: int = 1
    ratio: float = 0.0
    probe: str = "kv1"

    @property
    def repairs(self) -> bool:
        return self.tokens > 0 or self.ratio > 0


@dataclass
class Tally:
    """What a build did, in tokens (``kvruntime.messages.prefill.PrefillStats`` has the same
    fields: the executor passes its own). ``stages``: seconds per KV path stage."""
    computed: int = 0                 # through a forward pass (text, seams, selected tokens)
    reused: int = 0                   # loaded KV spliced as is (exact reuse)
    repositioned: int = 0             # chunk tokens re-rotated (seams and selected tokens excluded)
    erratum: int = 0                  # erratum tokens computed
    fallbacks: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)


def exactly_after(context: KVCache, prefix, start: int) -> bool:
    """True if ``context`` is exactly ``prefix`` (those token ids at positions 0..m-1) and KV
    compiled after it starts at ``start`` == m: that KV is then exact where it stands."""
    p = [int(t) for t in prefix]
    if context.num_tokens != len(p) or int(start) != len(p):
        return False
    if not p:
        return True
    return context.token_ids.tolist() == p and context.positions.tolist() == list(range(len(p)))


def naive_splice(chunk: KVCache, start: int) -> KVCache:
    """Claim positions start.. for ``chunk`` *without* re-rotating its keys: the baseline that
    shows why reposition exists. Never used by a plan."""
    return KVCache(chunk.data, torch.arange(start, start + chunk.num_tokens, device=chunk.positions.device),
                   chunk.token_ids)


def matches(kv: KVCache | None, token_ids, position: int) -> bool:
    """True if loaded ``kv`` holds exactly ``token_ids`` at ``position``.. (what a step says)."""
    ids = list(token_ids)
    return (kv is not None and kv.num_tokens == len(ids) and kv.token_ids.tolist() == ids
            and kv.positions.tolist() == list(range(position, position + len(ids))))


class Interpreter:
    """One build of one context: ``capacity`` slots, written left to right.

    ``tally``: where counts and stage seconds go (default a new :class:`Tally`). ``question``:
    the text question probes rank the chunks by; None (``compose``) = the text that follows the
    chunks; a tuple (the executor) = that text always (the plan's suffix). ``probe_fallback``:
    True (a prefill worker) = a probe that cannot run here (a question probe with no question,
    or any probe but ``kv1`` and ``q...``) runs as ``kv1``, the reason in ``tally.fallbacks`` and
    logged once; False = run as given (a question probe with no text after it raises ValueError).
    ``alloc``/``cancelled``: the :class:`Builder`'s."""

    def __init__(self, engine, capacity: int, *, tally: Tally | None = None, question=None, alloc=None,
                 cancelled=None, probe_cache: dict | None = None, probe_fallback: bool = False):
        self.engine = engine
        self.builder = Builder(engine, capacity, alloc=alloc, cancelled=cancelled)
        self.tally = Tally() if tally is None else tally
        self.question = None if question is None else tuple(question)
        self.probe_cache, self.probe_fallback = probe_cache, probe_fallback
        self.probed = 0                   # chunk tokens run through the probe layers (selective recompute)
        self._rule: SeamRule | None = None      # the pending seams' rule
        self._whole: KVCache | None = None      # the context, when it is one loaded KV taken as is

    # ---- what is built -------------------------------------------------------------------------
    @property
    def kv(self) -> KVCache:
        """The slots written so far (views of the builder's buffer, or the one KV taken whole)."""
        return self._whole if self._whole is not None else self.builder.kv

    @property
    def length(self) -> int:
        return self.kv.num_tokens

    @property
    def pending(self) -> bool:
        """Chunks whose seams are not repaired yet."""
        return bool(self.builder.seams)

    def follows(self, prefix, start: int) -> bool:
        """KV compiled after ``prefix`` and starting at ``start`` is exact after this context."""
        return exactly_after(self.kv, prefix, start)

    def finish(self) -> KVCache:
        """Repair what is pending; the context's KV (slots in position order)."""
        self.flush()
        return self.kv

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Add the block's wall time to ``tally.stages[stage]`` (stages repeat per step)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.tally.stages[stage] = self.tally.stages.get(stage, 0.0) + time.perf_counter() - t

    # ---- steps ----------------------------------------------------------------------------------
    def text(self, token_ids, position: int | None = None, *, logits: bool = False, erratum: bool = False):
        """Run ``token_ids`` in context at ``position``.. (default: after the last slot), after
        repairing pending seams. Returns the last token's logits when ``logits`` (else None)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return None
        self._writable()
        self.flush(ids)
        with self.timed("forward"):
            out = self.builder.compute(ids, position, logits=logits)
        if erratum:
            self.tally.erratum += len(ids)
        else:
            self.tally.computed += len(ids)
        return out if logits else None

    def splice(self, part: KVCache, *, computed: bool = False, whole: bool = False) -> None:
        """Loaded (or just compiled: ``computed``) KV copied after the slots written, pending
        seams repaired first. ``whole``: the caller's last write; with nothing written before,
        ``part`` becomes the context as is (no buffer, no copy)."""
        self._writable()
        self.flush()
        if not part.num_tokens:
            return
        if whole and self.builder.buf is None:
            self._whole = part.to(self.engine.device, self.engine.dtype)
        else:
            self.builder.append(part)
        if computed:
            self.tally.computed += part.num_tokens
        else:
            self.tally.reused += part.num_tokens

    def chunk(self, kv: KVCache, rule: SeamRule, position: int | None = None, *, rotate: bool = True) -> int:
        """A precompiled chunk placed at ``position`` (default: after the last slot): its keys
        re-rotated into its slots (``rotate`` False: placed without rotation, the naive
        baseline), its seam repaired by ``rule`` at the next :meth:`flush`. Chunks of one rule
        are repaired together; a chunk of another rule first flushes the pending ones.
        Returns the slot the chunk starts at."""
        self._writable()
        if self.pending and rule != self._rule:
            self.flush()
        start = self.builder.length
        if rule.repairs:
            self.builder.mark_seam()
            self._rule = rule
        at = self.builder.cursor if position is None else int(position)
        with self.timed("rerotate"):
            if rotate:
                self.builder.reposition(kv, at - int(kv.positions[0]))
            else:
                self.builder.append(naive_splice(kv, at))
        k = min(rule.tokens, kv.num_tokens)
        self.tally.computed += k
        self.tally.repositioned += kv.num_tokens - k
        return start

    def edit(self, cached: KVCache, field_span: tuple[int, int], new_tokens, top_k: int):
        """``ops.edit_in_place`` of ``cached`` (a stored context), written after the slots
        written (straight into the buffer when it is the first write), pending seams repaired
        first. Returns its ``EditResult``; raises ``RepositionDisabled`` like it."""
        from kvruntime.ops.edit import edit_in_place
        self._writable()
        self.flush()
        into = self.builder if not self.builder.length else None
        with self.timed("forward"):
            res = edit_in_place(self.engine, cached.to(self.engine.device, self.engine.dtype), field_span,
                                list(new_tokens), top_k, into=into)
        if into is None:
            self.builder.append(res.kv)
        self.tally.computed += res.recomputed_tokens
        self.tally.reused += res.kv.num_tokens - res.recomputed_tokens
        return res

    # ---- seams ------------------------------------------------------------------------------------
    def flush(self, following=None):
        """Repair the pending chunks' seams in ONE forward (``Builder.flush``); with the rule's
        ratio > 0 also recompute its top chunk tokens in it, ranked by the rule's probe (question
        probes by :attr:`question`, or ``following``: the text about to be run). Returns the
        ``BlendResult`` (None when nothing was pending)."""
        b, rule = self.builder, self._rule
        if not b.seams:
            return None
        question = self.question if self.question is not None else following
        probe = self._probe(rule, question)
        n_seams = len({i for s in b.seams for i in range(s, min(s + rule.tokens, b.length))})
        with self.timed("forward"):
            res = b.flush(rule.tokens, rule.ratio, probe, question, self.probe_cache)
        self._rule = None
        if rule.ratio > 0:
            extra = len(res.recomputed_slots) - n_seams
            self.tally.computed += extra
            self.tally.repositioned -= extra
            self.probed += res.probed_tokens
        return res

    def _probe(self, rule: SeamRule, question) -> str:
        if not self.probe_fallback or rule.ratio <= 0 or rule.probe == "kv1" \
                or (is_question_probe(rule.probe) and question):
            return rule.probe
        reason = "question_probe_without_suffix" if is_question_probe(rule.probe) else "unknown_probe"
        self.tally.fallbacks.append(reason)
        log_fallback_once(log, reason, "selective recompute: probe %r cannot run here (%s); kv1 used", rule.probe,
                          reason)
        return "kv1"

    def _writable(self) -> None:
        if self._whole is not None:
            raise RuntimeError("the context was taken whole (splice(whole=True)): nothing can be written after it")
