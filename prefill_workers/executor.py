"""Carry out a RequestPlan's prefix steps and ship the composed KV to a decode worker.

Executors never re-plan: a missing chunk or a disabled rotation does not change the plan, it
takes the configured fallback (recompute the step, or fail), which is counted in the result
and logged. The plan's token ids are the whole truth about the context. Each build is a
:class:`~prefill_workers.steps.PlanBuild` over the one interpreter of KV steps
(``kvruntime.ops.interpret``, what ``compose`` runs); the executor keeps no per-build state, so
it is re-entrant. The composed KV ships through a :class:`~kvtransport.transfer.interface.KVSender`.
"""
from __future__ import annotations

import logging
import time

from kvruntime.config.choices import LoadFailurePolicy
from kvruntime.engine import Cancelled
from kvruntime.kv import KVCache
from kvruntime.messages.fidelity import ShadowResult
from kvruntime.messages.plan import KVRef, RequestPlan
from kvruntime.messages.prefill import PrefillResult, PrefillStats
from kvruntime.messages.transfer import KVEndpoint
from kvtransport.transfer.interface import KVSender, TransferError
from prefill_workers.steps import KVSource, PlanBuild

log = logging.getLogger(__name__)

__all__ = ["KVSource", "PrefillExecutor"]


class PrefillExecutor:
    #: the per-build class (one instance per build, dropped with it); a subclass changes how steps run
    build_type: type[PlanBuild] = PlanBuild

    def __init__(self, engine, source: KVSource, transport: KVSender | None, *,
                 load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
                 transfer_timeout: float = 30.0, prefetch: int = 1):
        """``transport``: what :meth:`execute` ships with (None: an executor that only builds)."""
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0 (tier reads issued ahead of the step using them; 0: none)")
        self.engine, self.source, self.transport = engine, source, transport
        self.policy, self.transfer_timeout = LoadFailurePolicy.of(load_failure_policy), transfer_timeout
        self.prefetch = prefetch

    # ---- building ---------------------------------------------------------------------------
    def build(self, plan: RequestPlan, alloc=None, cancelled=None) -> tuple[KVCache, PrefillStats]:
        """Execute ``plan.steps`` in order; returns the prefix KV (slots in position order).
        The KV is written into ONE buffer of the plan's final size (``plan.prefix_tokens`` slots,
        the engine's dtype), allocated at the first write: each step writes its slots once
        (loaded KV copied, a repositioned chunk re-rotated straight into its slots, a computed
        step's new KV copied after attending to the slots before it), nothing is concatenated.
        A plan of one step returns that step's KV as is (an exact hit: no copy).
        ``alloc(shape, dtype) -> Tensor | None``: where that buffer is allocated
        (``KVSender.alloc``: the transport's registered memory, so the final KV ships without a
        copy; None: ordinary memory, counted as ``kv_send_pool_full``).
        ``cancelled() -> bool``: checked before each step and each layer of a computed step; True
        stops the build with ``kvruntime.engine.Cancelled``. The tier reads of later steps are
        issued ahead on one background thread (``prefetch`` reads at most), so the read of
        chunk i+1 overlaps the re-rotation and copy of chunk i (``prefill_workers.prefetch``)."""
        return self._plan_build(plan, alloc, cancelled).build()

    def _plan_build(self, plan: RequestPlan, alloc=None, cancelled=None, room: int = 0) -> PlanBuild:
        if plan.model != self.engine.spec.name:
            raise ValueError(f"plan is for model {plan.model!r}, this worker runs {self.engine.spec.name!r}")
        return self.build_type(self.engine, self.source, plan, policy=self.policy, prefetch=self.prefetch,
                               alloc=alloc, cancelled=cancelled, room=room)

    def shadow(self, plan: RequestPlan, greedy_n: int = 16) -> ShadowResult:
        """Online shadow check, off the request's critical path: build the prefix as planned, then
        recompute prefix + suffix in full and compare the first token and the greedy continuation."""
        from kvruntime.fidelity.metrics import compare
        from kvruntime.ops import recompute
        if not plan.suffix_ids:
            raise ValueError("a shadow check needs the plan's suffix (the question)")
        t = time.perf_counter()
        # built with room for the suffix and the greedy tokens, which run in the build's buffer (the
        # prefix is not copied; a plan taken whole is the tier's KV, copied once: engine.copied_bytes)
        build = self._plan_build(plan, room=len(plan.suffix_ids) + greedy_n)
        kv, _ = build.build()
        logits, got = self.engine.continue_greedy(build.run.builder.buf or kv, plan.suffix_ids, greedy_n)
        full = recompute(self.engine, list(plan.prefix_ids + plan.suffix_ids))
        row = compare(full.logits, self.engine.greedy(full.kv, full.logits, greedy_n, stop_at_eos=True), logits, got)
        return ShadowResult(plan.request_id, row["kl"], row["top1"], row["greedy_exact"], row["greedy_prefix"],
                            cosine=row["cosine"], seconds=time.perf_counter() - t)

    # ---- shipping ---------------------------------------------------------------------------
    def execute(self, plan: RequestPlan, decode: KVEndpoint | str, transfer_id: str,
                store_as: KVRef | None = None, credential: str = "", send_from: int = 0,
                cancelled=None) -> PrefillResult:
        """Build the prefix, optionally store it in the tier under ``store_as`` (a session's
        context or a plain prompt, for the next request), and push it to ``decode`` (the decode
        worker's endpoint; an address for a ``BlockKVSender``) with the transfer's
        ``credential``; only tokens from ``send_from`` on (the decode engine holds the rest, see
        ``DecodeWorker.expect``). ``cancelled() -> bool``: checked between steps and layers and
        before the push; True raises ``kvruntime.engine.Cancelled`` (nothing stored or sent). A
        failed push is reported (``transferred`` False + a fallback reason), never raised: the
        decode worker then recomputes. A failed store is counted (``tier_store_failed``) and logged."""
        if self.transport is None:
            raise ValueError("this executor was made without a KVSender: it builds, it cannot ship")
        t = time.perf_counter()
        # the whole prefix shipped in the wire dtype: built in the sender's registered memory, sent without a copy
        into_pool = not send_from and self.transport.builds_into_pool(decode, self.engine.dtype)
        kv, st = self.build(plan, self.transport.alloc if into_pool else None, cancelled)
        if cancelled is not None and cancelled():
            raise Cancelled("prefill cancelled")
        seconds = time.perf_counter() - t
        stored = self._store(plan, store_as, kv, st)
        st.not_sent = min(send_from, kv.num_tokens)
        ok, sent, tsec, used = self._ship(plan, decode, transfer_id, kv.slice(st.not_sent) if st.not_sent else kv,
                                          credential, st)
        return PrefillResult(plan.request_id, transfer_id, kv.num_tokens, seconds, sent, tsec, st, ok, stored, used)

    def _store(self, plan: RequestPlan, store_as: KVRef | None, kv: KVCache, st: PrefillStats) -> bool:
        """``source.put(store_as, kv)`` (the tier copies it: no tier keeps a view of the send pool)."""
        if store_as is None or not kv.num_tokens:
            return False
        if store_as.token_ids != plan.prefix_ids or store_as.position != 0 or store_as.approx != plan.approx:
            raise ValueError("store_as must name this plan's prefix at position 0 with the plan's exactness")
        try:
            self.source.put(store_as, kv)
            return True
        except Exception as exc:
            st.fallbacks.append("tier_store_failed")
            log.warning("storing the prefix of %s failed: %s", plan.request_id, exc)
            return False

    def _ship(self, plan: RequestPlan, decode, transfer_id: str, kv: KVCache, credential: str,
              st: PrefillStats) -> tuple[bool, int, float, str]:
        """(delivered, bytes sent, seconds, the transport that carried it); a failed push is
        counted in ``st.fallbacks`` (``kv_transfer_<reason>``) and logged, not raised."""
        try:
            res = self.transport.send(decode, transfer_id, plan.model, kv, credential=credential,
                                      timeout=self.transfer_timeout)
        except TransferError as exc:
            st.fallbacks.append(f"kv_transfer_{exc.reason}")
            log.warning("KV transfer %s failed (%s): decode worker will recompute", transfer_id, exc)
            return False, 0, 0.0, ""
        st.stages.update(res.stages)
        st.fallbacks.extend(res.fallbacks)
        return True, res.receipt.bytes_sent, res.receipt.seconds, res.transport
