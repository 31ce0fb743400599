"""Carry out a RequestPlan's prefix steps and ship the composed KV to a decode worker.

Executors never re-plan: a missing chunk or a disabled rotation does not change the plan, it
takes the configured fallback (recompute the step, or fail), which is counted in the result
and logged. The plan's token ids are the whole truth about the context.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol

import torch

from kvruntime.engine import Cancelled
from kvruntime.kv import KVCache
from kvruntime.messages.fidelity import ShadowResult
from kvruntime.messages.plan import KVRef, PlanKind, RequestPlan, SegmentPlan
from kvruntime.messages.prefill import PrefillResult, PrefillStats
from kvruntime.messages.transfer import KVEndpoint
from kvruntime.ops import edit_in_place
from kvruntime.ops.build import Builder
from kvruntime.rope import RepositionDisabled
from kvruntime.telemetry import log_fallback_once
from kvtransport.transfer.blocks import encode_block
from kvtransport.transfer.endpoints import Sender
from kvtransport.transfer.interface import KVSender, TransferError
from prefill_workers.prefetch import Prefetcher

log = logging.getLogger(__name__)
_LOADS = (PlanKind.REUSE, PlanKind.REPOSITION, PlanKind.EDIT_IN_PLACE)   # steps that read the tier first


def _check(cancelled) -> None:
    if cancelled is not None and cancelled():
        raise Cancelled("prefill cancelled")


@contextlib.contextmanager
def _timed(st: PrefillStats, stage: str):
    """Add the block's wall time to ``st.stages[stage]`` (stages repeat per plan step)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        st.stages[stage] = st.stages.get(stage, 0.0) + time.perf_counter() - t


class KVSource(Protocol):
    """What the executor needs from the tier (``prefill_workers.tier.PrefillTier``): KV by content
    reference (None on a miss), storing, and re-warming a missing chunk."""

    def get(self, ref: KVRef) -> KVCache | None: ...

    def put(self, ref: KVRef, kv: KVCache) -> int: ...      # copies kv: keeps no view of it

    def compile(self, ref: KVRef) -> KVCache: ...


class PrefillExecutor:
    def __init__(self, engine, source: KVSource, transport: KVSender | Sender, *,
                 load_failure_policy: str = "recompute",
                 transfer_timeout: float = 30.0, prefetch: int = 1):
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0 (tier reads issued ahead of the step using them; 0: none)")
        self.engine, self.source, self.transport = engine, source, transport
        self.policy, self.transfer_timeout = load_failure_policy, transfer_timeout
        self.prefetch = prefetch
        self._ahead: Prefetcher | None = None

    # ---- building ---------------------------------------------------------------------------
    def build(self, plan: RequestPlan, alloc=None, cancelled=None) -> tuple[KVCache, PrefillStats]:
        """Execute ``plan.steps`` in order; returns the prefix KV (slots in position order).
        The KV is written into ONE buffer of the plan's final size (``plan.prefix_tokens`` slots,
        the engine's dtype), allocated at the first write: each step writes its slots once
        (loaded KV copied, a repositioned chunk re-rotated straight into its slots, a computed
        step's new KV copied after attending to the slots before it), nothing is concatenated.
        A plan of one step returns that step's KV as is (an exact hit: no copy).
        ``alloc(shape, dtype) -> Tensor | None``: where that buffer is allocated
        (``Sender.alloc``: the transport's registered memory, so the final KV ships without a copy;
        None: ordinary memory, counted by :meth:`execute` as ``kv_send_pool_full``).
        ``cancelled() -> bool``: checked before each step and each layer of a computed step; True
        stops the build with ``kvruntime.engine.Cancelled``. The tier reads of later steps are
        issued ahead on one background thread (``prefetch`` reads at most), so the read of
        chunk i+1 overlaps the re-rotation and copy of chunk i (``prefill_workers.prefetch``)."""
        if plan.model != self.engine.spec.name:
            raise ValueError(f"plan is for model {plan.model!r}, this worker runs {self.engine.spec.name!r}")
        kv, st = self.engine.empty_kv(), PrefillStats()
        # the one builder (kvruntime.ops.build): the same code compose() runs for the harness
        self._b = Builder(self.engine, plan.prefix_tokens, alloc=alloc, cancelled=cancelled)
        self._seam_k, self._ratio = 0, 0.0       # ratio > 0: selective recompute (ops.blend)
        self._probe, self._question = "kv1", plan.suffix_ids   # q probes rank by the plan's suffix (ops.qselect)
        self._cancelled = cancelled
        self._final = False
        refs = [s.kv for s in plan.steps if s.kind in _LOADS and s.kv is not None]
        self._ahead = Prefetcher(self.source, refs, self.prefetch) if self.prefetch and len(refs) > 1 else None
        try:
            for i, step in enumerate(plan.steps):
                _check(cancelled)
                if step.kind is not PlanKind.REPOSITION:
                    kv = self._flush_seams(kv, st)        # computed steps must see repaired seams
                self._final = i == len(plan.steps) - 1
                kv = self._step(kv, step, st)
            kv = self._flush_seams(kv, st)
        finally:
            if self._ahead is not None:
                self._ahead.close()                       # reads not started are cancelled
            self._ahead = None
            self._pool_misses = self._b.pool_misses
            self._b = None                                # a cancelled build's pool lease ends with it
        self._alloc = self._cancelled = None
        return kv, st

    def _splice(self, kv: KVCache, part: KVCache) -> KVCache:
        """``kv`` + ``part`` (loaded or freshly computed KV): ``part`` is copied into its slots of
        the buffer (cast to the engine's dtype as it is written; a tier's memory is only read).
        Cost: one copy of ``part``. A plan whose whole KV is ``part`` gets it as is."""
        if not part.num_tokens:
            return kv
        if self._final and self._b.buf is None and not kv.num_tokens:
            return part.to(self.engine.device, self.engine.dtype)
        return self._b.append(part)

    def _reposition_into(self, kv: KVCache, chunk: KVCache, delta: int, st: PrefillStats) -> KVCache:
        """``kv`` + ``chunk`` moved by ``delta``: the chunk's keys are re-rotated straight into
        its slots of the buffer (registered memory when the pool had room), in the engine's
        dtype; ``chunk`` (a tier's memory) is only read. Cost: one pass over the chunk."""
        with _timed(st, "rerotate"):
            return self._b.reposition(chunk, delta)

    def _flush_seams(self, kv: KVCache, st: PrefillStats) -> KVCache:
        """Repair the pending chunks' seams in place (``Builder.flush``); with the plan's r > 0
        also recompute the top-r chunk tokens in the same forward, ranked by the step's probe:
        ``kv1`` (``ops.blend``: layer-1 K deviation) or a question probe ``q...`` (``ops.qselect``:
        the attention the plan's suffix, the question, pays to each chunk slot when run right
        after the composed KV; exactly ``compose(...)``'s choice when the chunks are the last
        prefix step). A q probe with no suffix to rank by falls back to kv1 (``st.fallbacks``:
        "question_probe_without_suffix")."""
        b = self._b
        if not b.seams:
            return kv
        from kvruntime.ops.probes import is_question_probe
        probe = self._probe
        if self._ratio > 0 and not (is_question_probe(probe) and self._question) and probe != "kv1":
            reason = "question_probe_without_suffix" if is_question_probe(probe) else "unknown_probe"
            st.fallbacks.append(reason)
            log_fallback_once(log, reason, "selective recompute: probe %r cannot run here (%s); kv1 used", probe, reason)
            probe = "kv1"
        n_seams = len({i for c in b.seams for i in range(c, min(c + self._seam_k, b.length))})
        with _timed(st, "forward"):
            res = b.flush(self._seam_k, self._ratio, probe, self._question)
        if self._ratio > 0:
            extra = len(res.recomputed_slots) - n_seams
            st.computed += extra
            st.repositioned -= extra
        return b.kv

    def _fallback(self, step: SegmentPlan, reason: str, st: PrefillStats) -> None:
        st.fallbacks.append(reason)
        log.warning("plan step %s (%s): %s; policy %s", step.kind.value, step.source, reason, self.policy)
        if self.policy == "fail":
            raise RuntimeError(f"{step.source}: {reason} (kv load failure policy is 'fail')")

    def _load(self, ref: KVRef | None, st: PrefillStats) -> KVCache | None:
        if ref is None:
            return None
        st.tier_lookups += 1
        with _timed(st, "tier_get"):                     # waiting for it: what overlap did not hide
            got = self._ahead.take(ref) if self._ahead is not None else self.source.get(ref)
        st.tier_hits += got is not None
        return got

    def _rewarm(self, step: SegmentPlan, st: PrefillStats) -> KVCache | None:
        """A registered chunk this worker's tiers do not hold (evicted, or first use on this
        node): compile it at its canonical position and store it back (counted), so the plan's
        reposition runs as planned and the next use hits."""
        try:
            with _timed(st, "forward"):
                kv = self.source.compile(step.kv)
        except Exception as exc:           # a tier that refuses the write: recompute in context
            log.warning("re-warming %s failed (%s)", step.source, exc)
            return None
        st.rewarmed += 1
        log.info("re-warmed %s (%d tokens) into this worker's tier", step.source, step.tokens)
        return kv

    def _frame_reuse(self, kv: KVCache, step: SegmentPlan, loaded: KVCache | None, st: PrefillStats) -> KVCache:
        """KV compiled after exactly the context built so far (``step.kv.prefix``): the planner's
        frame variant is the chat frame + the first chunk compiled together from position 0
        (prefix ``()``, the context still empty). Spliced as is, bit-for-bit the KV a recompute
        gives it. A variant the tier does not hold is compiled now and stored
        (``variants_compiled``); a context that is not the variant's prefix, or a loaded KV whose
        ids or positions are not the step's (a plan/executor mismatch) is a counted fallback."""
        prefix = list(step.kv.prefix)
        if kv.token_ids.tolist() != prefix or kv.positions.tolist() != list(range(len(prefix))) \
                or step.position != len(prefix):
            self._fallback(step, "kv_mismatch", st)
            return self._compute(kv, step.token_ids, step.position, st)
        compiled = loaded is None
        if compiled:
            try:
                with _timed(st, "forward"):
                    loaded = self.source.compile(step.kv)
            except Exception as exc:       # a tier that refuses the write: recompute in context
                log.warning("compiling %s after its frame failed (%s)", step.source, exc)
                self._fallback(step, "kv_load_failed", st)
                return self._compute(kv, step.token_ids, step.position, st)
            st.variants_compiled += 1
            log.info("compiled %s (%d tokens, after %d prefix tokens) into this worker's tier", step.source,
                     step.tokens, len(prefix))
        if loaded.token_ids.tolist() != list(step.token_ids) \
                or loaded.positions.tolist() != list(range(step.position, step.position + step.tokens)):
            self._fallback(step, "kv_mismatch", st)
            return self._compute(kv, step.token_ids, step.position, st)
        if compiled:
            st.computed += step.tokens     # a non-empty prefix was computed again inside the compile: not counted
        else:
            st.reused += step.tokens
        return self._splice(kv, loaded)

    def _compute(self, kv: KVCache, ids, position: int, st: PrefillStats) -> KVCache:
        if not ids:
            return kv
        with _timed(st, "forward"):
            self._b.compute(list(ids), position)       # written in place after the slots before it
        st.computed += len(ids)
        return self._b.kv

    def _step(self, kv: KVCache, step: SegmentPlan, st: PrefillStats) -> KVCache:
        k = step.kind
        if k is PlanKind.RECOMPUTE:
            return self._compute(kv, step.token_ids, step.position, st)
        if k is PlanKind.ERRATUM:
            before = st.computed
            kv = self._compute(kv, step.token_ids, step.position, st)
            st.erratum += st.computed - before
            st.computed = before
            return kv
        loaded = self._load(step.kv, st)
        if k is PlanKind.REPOSITION and loaded is None and step.kv is not None:
            loaded = self._rewarm(step, st)
        if k is PlanKind.REUSE and step.kv is not None and step.kv.prefix is not None:
            return self._frame_reuse(kv, step, loaded, st)
        if k is PlanKind.REUSE:
            ok = (loaded is not None and loaded.num_tokens == step.tokens
                  and loaded.token_ids.tolist() == list(step.token_ids)
                  and int(loaded.positions[0]) == step.position)
            if not ok:
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            st.reused += step.tokens
            return self._splice(kv, loaded)
        if k is PlanKind.REPOSITION:
            if loaded is None or loaded.token_ids.tolist() != list(step.token_ids):
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            if not self.engine.rope.enabled:
                self._fallback(step, "reposition_disabled", st)
                return self._compute(kv, step.token_ids, step.position, st)
            if self._b.seams and (step.seam_tokens, step.recompute_ratio, step.probe) != (self._seam_k, self._ratio,
                                                                                          self._probe):
                kv = self._flush_seams(kv, st)
            if step.seam_tokens or step.recompute_ratio:
                self._b.mark_seam()
                self._seam_k, self._ratio, self._probe = step.seam_tokens, step.recompute_ratio, step.probe
            kv = self._reposition_into(kv, loaded, step.position - int(loaded.positions[0]), st)
            st.computed += step.seam_tokens
            st.repositioned += step.tokens - step.seam_tokens
            return kv
        if k is PlanKind.EDIT_IN_PLACE:
            a, b = step.field_span
            n_new = step.tokens - (loaded.num_tokens - (b - a)) if loaded is not None else 0
            if loaded is None or n_new <= 0:
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            into = self._b if not self._b.length else None      # the edited context written into the buffer
            try:
                with _timed(st, "forward"):
                    res = edit_in_place(self.engine, loaded.to(self.engine.device, self.engine.dtype), (a, b),
                                        list(step.token_ids[a:a + n_new]), step.top_k, into=into)
            except RepositionDisabled:            # the field's length changed and rotation is off
                self._fallback(step, "reposition_disabled", st)
                return self._compute(kv, step.token_ids, step.position, st)
            st.computed += res.recomputed_tokens
            st.reused += step.tokens - res.recomputed_tokens
            return res.kv if into is not None else self._splice(kv, res.kv)
        raise ValueError(f"unknown plan step kind {k}")

    def shadow(self, plan: RequestPlan, greedy_n: int = 16) -> ShadowResult:
        """Online shadow check, off the request's critical path: build the prefix as planned, then
        recompute prefix + suffix in full and compare the first token and the greedy continuation."""
        from kvruntime.fidelity.metrics import compare
        from kvruntime.ops import recompute
        if not plan.suffix_ids:
            raise ValueError("a shadow check needs the plan's suffix (the question)")
        t = time.perf_counter()
        kv, _ = self.build(plan)
        start = int(kv.positions[-1]) + 1 if kv.num_tokens else 0
        out = self.engine.prefill(list(plan.suffix_ids), torch.arange(start, start + len(plan.suffix_ids)), kv,
                                  logits=True)
        got = self.engine.greedy(KVCache.cat([kv, out.kv]), out.logits, greedy_n, stop_at_eos=True)
        full = recompute(self.engine, list(plan.prefix_ids + plan.suffix_ids))
        row = compare(full.logits, self.engine.greedy(full.kv, full.logits, greedy_n, stop_at_eos=True), out.logits, got)
        return ShadowResult(plan.request_id, row["kl"], row["top1"], row["greedy_exact"], row["greedy_prefix"],
                            cosine=row["cosine"], seconds=time.perf_counter() - t)

    # ---- shipping ---------------------------------------------------------------------------
    def _pool_alloc(self, decode, send_from: int):
        """``Sender.alloc`` when the whole prefix will be shipped over NIXL in the engine's dtype:
        the build then assembles it in registered memory and the send copies nothing. The tier
        store (``source.put``) copies the KV into the tier, so no tier keeps a view of the pool."""
        t = self.transport
        if (isinstance(t, Sender) and isinstance(decode, KVEndpoint) and not send_from
                and self.engine.device.type == "cpu" and t.builds_into_pool(decode, self.engine.dtype)):
            return t.alloc
        return None

    def execute(self, plan: RequestPlan, decode: KVEndpoint | str, transfer_id: str,
                store_as: KVRef | None = None, credential: str = "", send_from: int = 0,
                cancelled=None) -> PrefillResult:
        """Build the prefix, optionally store it in the tier under ``store_as`` (a session's
        context or a plain prompt, for the next request), and push it to ``decode`` (an endpoint
        for a :class:`~kvtransport.transfer.endpoints.Sender`, an address for a plain transport) with the
        transfer's ``credential``; only tokens from ``send_from`` on (the decode engine holds the
        rest, see ``DecodeWorker.expect``). ``cancelled() -> bool``: checked between steps and
        layers and before the push; True raises ``kvruntime.engine.Cancelled`` (nothing stored or sent). A failed push is reported (``transferred`` False + a fallback
        reason), never raised: the decode worker then recomputes. A failed store is counted
        (``tier_store_failed``) and logged."""
        t = time.perf_counter()
        alloc = self._pool_alloc(decode, send_from)
        try:
            kv, st = self.build(plan, alloc, cancelled)
        finally:
            self._alloc = self._cancelled = None
        _check(cancelled)
        built = time.perf_counter() - t
        if self._pool_misses:                     # built (partly) in ordinary memory: the send copies
            st.fallbacks.append("kv_send_pool_full")
            log_fallback_once(log, "kv_send_pool_full", "NIXL send pool full: KV built in ordinary memory and "
                              "copied into the pool by the send")
        stored = False
        if store_as is not None and kv.num_tokens:
            if store_as.token_ids != plan.prefix_ids or store_as.position != 0 or store_as.approx != plan.approx:
                raise ValueError("store_as must name this plan's prefix at position 0 with the plan's exactness")
            try:
                self.source.put(store_as, kv)
                stored = True
            except Exception as exc:
                st.fallbacks.append("tier_store_failed")
                log.warning("storing the prefix of %s failed: %s", plan.request_id, exc)
        sent, tsec, ok, used = 0, 0.0, True, ""
        st.not_sent = min(send_from, kv.num_tokens)
        ship = kv.slice(st.not_sent) if st.not_sent else kv
        try:
            if isinstance(self.transport, Sender):
                if not isinstance(decode, KVEndpoint):
                    raise TypeError("a Sender sends to a KVEndpoint")
                receipt, used, stages, fallbacks = self.transport.send(
                    decode, transfer_id, plan.model, ship, credential=credential, timeout=self.transfer_timeout)
                st.stages.update(stages)
                st.fallbacks.extend(fallbacks)
            else:
                with _timed(st, "serialise"):
                    block = encode_block(transfer_id, plan.model, ship, credential=credential)
                receipt = self.transport.send(decode, block, timeout=self.transfer_timeout)
                del block
                used = getattr(self.transport, "kind", "")
                st.stages["transfer"] = receipt.seconds
            sent, tsec = receipt.bytes_sent, receipt.seconds
        except TransferError as exc:
            ok, used = False, ""
            st.fallbacks.append(f"kv_transfer_{exc.reason}")
            log.warning("KV transfer %s failed (%s): decode worker will recompute", transfer_id, exc)
        return PrefillResult(plan.request_id, transfer_id, kv.num_tokens, built, sent, tsec, st, ok, stored, used)
