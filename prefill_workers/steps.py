"""One build of a plan's prefix: its steps carried out through the one interpreter.

A :class:`PlanBuild` is made per build by :meth:`PrefillExecutor.build
<prefill_workers.executor.PrefillExecutor.build>` and dropped with it: the plan, its
:class:`~kvruntime.ops.interpret.Interpreter` (the builder, seam rule and counts), the stats and
the tier reads issued ahead live here, never on the long-lived executor, so builds are
re-entrant. The KV rules (flush before a write that is not a repositioned chunk, seam
accounting, the exact-follow check) are the interpreter's, the same ``compose`` runs; what is
here is a plan's own: tier loads, re-warming a chunk the tier lost, frame variants compiled on
first use, and the configured fallback (recompute the step, or fail) when KV is missing or wrong.
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from kvruntime.engine import Cancelled
from kvruntime.kv import KVCache
from kvruntime.messages.decode import TokenLogprob
from kvruntime.messages.plan import KVRef, PlanKind, RequestPlan, SegmentPlan
from kvruntime.messages.prefill import PrefillStats
from kvruntime.ops.interpret import Interpreter, SeamRule, matches
from kvruntime.rope import RepositionDisabled
from kvruntime.telemetry import log_fallback_once
from prefill_workers.prefetch import Prefetcher

log = logging.getLogger(__name__)
_LOADS = (PlanKind.REUSE, PlanKind.REPOSITION, PlanKind.EDIT_IN_PLACE)   # steps that read the tier first


class KVSource(Protocol):
    """What a build needs from the tier (``prefill_workers.tier_reads.PrefillTier``): KV by
    content reference (None on a miss), storing, and re-warming a missing chunk."""

    def get(self, ref: KVRef) -> KVCache | None: ...

    def put(self, ref: KVRef, kv: KVCache) -> int: ...      # copies kv: keeps no view of it

    def compile(self, ref: KVRef) -> KVCache: ...


SCORED_ROWS = 256      # tokens per forward when a plan asks for the prompt's log-probs ([rows, vocab] fp32 each)


def token_logprobs(rows, next_ids, k: int) -> list[TokenLogprob]:
    """Per logits row (``rows``: [q, vocab]), the raw log-softmax of the token that follows it
    (``next_ids``, q of them) and the ``k`` most likely tokens, best first (vLLM's ``prompt_logprobs``)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    got = lp.gather(1, torch.as_tensor(list(next_ids), device=lp.device)[:, None])[:, 0].tolist()
    top = lp.topk(k, dim=-1) if k else None
    tops = zip(top.indices.tolist(), top.values.tolist()) if k else [((), ())] * len(got)
    return [TokenLogprob(int(t), g, tuple(zip(i, v))) for t, g, (i, v) in zip(next_ids, got, tops)]


class PlanBuild:
    def __init__(self, engine, source: KVSource, plan: RequestPlan, *, policy: str, prefetch: int,
                 alloc=None, cancelled=None, room: int = 0):
        if room < 0 or (room and alloc is not None):
            raise ValueError("room (slots after the prefix) must be >= 0, and 0 with alloc (the buffer ships at its shape)")
        self.engine, self.source, self.plan, self.policy = engine, source, plan, policy
        self.cancelled = cancelled
        self.st = PrefillStats()
        # q probes rank the chunks by the plan's suffix (ops.qselect), the question the decode runs
        self.run = Interpreter(engine, plan.prefix_tokens + room, tally=self.st, question=plan.suffix_ids, alloc=alloc,
                               cancelled=cancelled, probe_fallback=True)
        self.prefetch = prefetch
        self.ahead: Prefetcher | None = None

    def build(self) -> tuple[KVCache, PrefillStats]:
        """Every step in order, then the pending seams: the prefix KV (slots in position order)
        and its stats. The reads not started are cancelled however it ends (a cancelled build's
        pool lease ends with it). A buffer the ``alloc`` hook had no room for was built in
        ordinary memory: counted (``kv_send_pool_full``), the send then copies it."""
        steps = self.plan.steps
        refs = [s.kv for s in steps if s.kind in _LOADS and s.kv is not None]
        if self.prefetch and len(refs) > 1:
            self.ahead = Prefetcher(self.source, refs, self.prefetch)
        try:
            for i, step in enumerate(steps):
                if self.cancelled is not None and self.cancelled():
                    raise Cancelled("prefill cancelled")
                self._step(step, last=i == len(steps) - 1)
            kv = self.run.finish()
        finally:
            if self.ahead is not None:
                self.ahead.close()
        if self.run.builder.pool_misses:
            self.st.fallbacks.append("kv_send_pool_full")
            log_fallback_once(log, "kv_send_pool_full", "NIXL send pool full: KV built in ordinary memory and "
                              "copied into the pool by the send")
        return kv, self.st

    # ---- the steps ----------------------------------------------------------------------------
    def _step(self, step: SegmentPlan, last: bool) -> None:
        k = step.kind
        if k is PlanKind.RECOMPUTE and self.plan.prompt_logprobs is not None:
            return self._scored(step)
        if k is PlanKind.RECOMPUTE or k is PlanKind.ERRATUM:
            self.run.text(step.token_ids, step.position, erratum=k is PlanKind.ERRATUM)
            return
        if k not in _LOADS:
            raise ValueError(f"unknown plan step kind {k}")
        loaded = self._load(step.kv)
        if k is PlanKind.REUSE and step.kv is not None and step.kv.prefix is not None:
            self._frame_reuse(step, loaded, last)
        elif k is PlanKind.REUSE:
            if not matches(loaded, step.token_ids, step.position):
                self._recompute(step, "kv_load_failed" if loaded is None else "kv_mismatch")
            else:
                self.run.splice(loaded, whole=last)
        elif k is PlanKind.REPOSITION:
            self._reposition(step, loaded)
        else:
            self._edit(step, loaded)

    def _scored(self, step: SegmentPlan) -> None:
        """A recompute whose logits rows are kept (``plan.prompt_logprobs``): each token's row gives
        the log-prob of the prompt token after it (the suffix's first after the prefix's last) and
        the top ``k``, into ``st.prompt_logprobs``; forwards of at most ``SCORED_ROWS`` tokens."""
        ids, at = list(step.token_ids), self.run.length
        after = self.plan.prefix_ids + self.plan.suffix_ids
        for i in range(0, len(ids), SCORED_ROWS):
            part = ids[i:i + SCORED_ROWS]
            rows = self.run.text(part, step.position + i, logits="all")
            self.st.prompt_logprobs.extend(token_logprobs(rows, after[at + i + 1:at + i + 1 + len(part)],
                                                          self.plan.prompt_logprobs))

    def _recompute(self, step: SegmentPlan, reason: str) -> None:
        """The step's fallback: counted and logged; recomputed in context, or (policy ``fail``) raised."""
        self.st.fallbacks.append(reason)
        log.warning("plan step %s (%s): %s; policy %s", step.kind.value, step.source, reason, self.policy)
        if self.policy == "fail":
            raise RuntimeError(f"{step.source}: {reason} (kv load failure policy is 'fail')")
        self.run.text(step.token_ids, step.position)

    def _load(self, ref: KVRef | None) -> KVCache | None:
        if ref is None:
            return None
        self.st.tier_lookups += 1
        with self.run.timed("tier_get"):                 # waiting for it: what overlap did not hide
            got = self.ahead.take(ref) if self.ahead is not None else self.source.get(ref)
        self.st.tier_hits += got is not None
        return got

    def _compile(self, step: SegmentPlan, what: str) -> KVCache | None:
        """``source.compile(step.kv)`` (stored back by the tier); None when the tier refuses the write."""
        try:
            with self.run.timed("forward"):
                return self.source.compile(step.kv)
        except Exception as exc:           # a tier that refuses the write: the caller recomputes in context
            log.warning("%s %s failed (%s)", what, step.source, exc)
            return None

    def _reposition(self, step: SegmentPlan, loaded: KVCache | None) -> None:
        if loaded is None and step.kv is not None:
            # a registered chunk this worker's tiers do not hold (evicted, or first use on this
            # node): compiled at its canonical position and stored back (counted), so the plan's
            # reposition runs as planned and the next use hits
            loaded = self._compile(step, "re-warming")
            if loaded is not None:
                self.st.rewarmed += 1
                log.info("re-warmed %s (%d tokens) into this worker's tier", step.source, step.tokens)
        if loaded is None or loaded.token_ids.tolist() != list(step.token_ids):
            return self._recompute(step, "kv_load_failed" if loaded is None else "kv_mismatch")
        if not self.engine.rope.enabled:
            return self._recompute(step, "reposition_disabled")
        self.run.chunk(loaded, SeamRule(step.seam_tokens, step.recompute_ratio, step.probe), step.position)

    def _frame_reuse(self, step: SegmentPlan, loaded: KVCache | None, last: bool) -> None:
        """KV compiled after exactly the context built so far (``step.kv.prefix``): the planner's
        frame variant is the chat frame + the first chunk compiled together from position 0
        (prefix ``()``, the context still empty). Spliced as is, bit-for-bit the KV a recompute
        gives it. A variant the tier does not hold is compiled now and stored
        (``variants_compiled``); a context that is not the variant's prefix, or a loaded KV whose
        ids or positions are not the step's (a plan/executor mismatch) is a counted fallback."""
        prefix = step.kv.prefix
        if not self.run.follows(prefix, step.position):
            return self._recompute(step, "kv_mismatch")
        compiled = loaded is None
        if compiled:
            loaded = self._compile(step, "compiling after its frame")
            if loaded is None:
                return self._recompute(step, "kv_load_failed")
            self.st.variants_compiled += 1
            log.info("compiled %s (%d tokens, after %d prefix tokens) into this worker's tier", step.source,
                     step.tokens, len(prefix))
        if not matches(loaded, step.token_ids, step.position):
            return self._recompute(step, "kv_mismatch")
        # compiled now: its tokens count as computed (a non-empty prefix computed again inside the compile is not)
        self.run.splice(loaded, computed=compiled, whole=last)

    def _edit(self, step: SegmentPlan, loaded: KVCache | None) -> None:
        a, b = step.field_span
        n_new = step.tokens - (loaded.num_tokens - (b - a)) if loaded is not None else 0
        if loaded is None or n_new <= 0:
            return self._recompute(step, "kv_load_failed" if loaded is None else "kv_mismatch")
        try:
            self.run.edit(loaded, (a, b), step.token_ids[a:a + n_new], step.top_k)
        except RepositionDisabled:            # the field's length changed and rotation is off
            self._recompute(step, "reposition_disabled")
