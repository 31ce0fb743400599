"""Carry out a RequestPlan's prefix steps and ship the composed KV to a decode worker.

Executors never re-plan: a missing chunk or a disabled rotation does not change the plan, it
takes the configured fallback (recompute the step, or fail), which is counted in the result
and logged. The plan's token ids are the whole truth about the context.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cluster.plan import PlanKind, RequestPlan, SegmentPlan
from kvruntime.kv import KVCache
from kvruntime.ops import edit_in_place, reposition, seam_repair
from kvruntime.rope import RepositionDisabled
from kvtransport.blocks import encode_block
from kvtransport.transport import KVTransport, TransferError

log = logging.getLogger(__name__)


class KVSource(Protocol):
    """What the executor needs from the tier: KV by key (None on a miss), and storing."""

    def get_kv(self, key: str) -> KVCache | None: ...

    def put_kv(self, key: str, kv: KVCache) -> None: ...


@dataclass
class PrefillStats:
    computed: int = 0                 # tokens through a forward pass
    reused: int = 0                   # tokens loaded exactly (reuse)
    repositioned: int = 0             # tokens loaded and re-rotated
    erratum: int = 0                  # erratum tokens computed
    tier_lookups: int = 0
    tier_hits: int = 0
    fallbacks: list[str] = field(default_factory=list)   # reasons, one per fallback taken


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    transfer_id: str
    prefix_tokens: int
    seconds: float                    # building the prefix KV
    transfer_bytes: int
    transfer_seconds: float
    stats: PrefillStats
    transferred: bool                 # False: the decode worker must recompute (reason in stats.fallbacks)


class PrefillExecutor:
    def __init__(self, engine, source: KVSource, transport: KVTransport, *, load_failure_policy: str = "recompute",
                 transfer_timeout: float = 30.0):
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        self.engine, self.source, self.transport = engine, source, transport
        self.policy, self.transfer_timeout = load_failure_policy, transfer_timeout

    # ---- building ---------------------------------------------------------------------------
    def build(self, plan: RequestPlan) -> tuple[KVCache, PrefillStats]:
        """Execute ``plan.steps`` in order; returns the prefix KV (slots in position order)."""
        if plan.model != self.engine.spec.name:
            raise ValueError(f"plan is for model {plan.model!r}, this worker runs {self.engine.spec.name!r}")
        kv, st = self.engine.empty_kv(), PrefillStats()
        self._seams: list[int] = []               # chunk starts awaiting one batched seam repair
        self._seam_k = 0
        for step in plan.steps:
            if step.kind is not PlanKind.REPOSITION:
                kv = self._flush_seams(kv)            # computed steps must see repaired seams
            kv = self._step(kv, step, st)
        return self._flush_seams(kv), st

    def _flush_seams(self, kv: KVCache) -> KVCache:
        if self._seams:
            kv = seam_repair(self.engine, kv, self._seams, self._seam_k)
            self._seams = []
        return kv

    def _fallback(self, step: SegmentPlan, reason: str, st: PrefillStats) -> None:
        st.fallbacks.append(reason)
        log.warning("plan step %s (%s): %s; policy %s", step.kind.value, step.source, reason, self.policy)
        if self.policy == "fail":
            raise RuntimeError(f"{step.source}: {reason} (kv load failure policy is 'fail')")

    def _load(self, key: str | None, st: PrefillStats) -> KVCache | None:
        if key is None:
            return None
        st.tier_lookups += 1
        got = self.source.get_kv(key)
        st.tier_hits += got is not None
        return got

    def _compute(self, kv: KVCache, ids, position: int, st: PrefillStats) -> KVCache:
        if not ids:
            return kv
        out = self.engine.prefill(list(ids), torch.arange(position, position + len(ids)), kv)
        st.computed += len(ids)
        return KVCache.cat([kv, out.kv])

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
        loaded = self._load(step.chunk_key, st)
        if k is PlanKind.REUSE:
            if loaded is not None and loaded.num_tokens > step.tokens:
                loaded = loaded.slice(0, step.tokens)        # a longer cached prefix: take what matches
            ok = (loaded is not None and loaded.num_tokens == step.tokens
                  and loaded.token_ids.tolist() == list(step.token_ids)
                  and int(loaded.positions[0]) == step.position)
            if not ok:
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            st.reused += step.tokens
            return KVCache.cat([kv, loaded.to(self.engine.device, self.engine.dtype)])
        if k is PlanKind.REPOSITION:
            if loaded is None or loaded.token_ids.tolist() != list(step.token_ids):
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            try:
                moved = reposition(self.engine.rope, loaded.to(self.engine.device, self.engine.dtype),
                                   step.position - int(loaded.positions[0]))
            except RepositionDisabled:
                self._fallback(step, "reposition_disabled", st)
                return self._compute(kv, step.token_ids, step.position, st)
            if step.seam_tokens:
                if self._seams and step.seam_tokens != self._seam_k:
                    kv = self._flush_seams(kv)
                self._seams.append(kv.num_tokens)
                self._seam_k = step.seam_tokens
            kv = KVCache.cat([kv, moved])
            st.computed += step.seam_tokens
            st.repositioned += step.tokens - step.seam_tokens
            return kv
        if k is PlanKind.EDIT_IN_PLACE:
            a, b = step.field_span
            n_new = step.tokens - (loaded.num_tokens - (b - a)) if loaded is not None else 0
            if loaded is None or n_new <= 0:
                self._fallback(step, "kv_load_failed" if loaded is None else "kv_mismatch", st)
                return self._compute(kv, step.token_ids, step.position, st)
            try:
                res = edit_in_place(self.engine, loaded.to(self.engine.device, self.engine.dtype), (a, b),
                                    list(step.token_ids[a:a + n_new]), step.top_k)
            except RepositionDisabled:            # the field's length changed and rotation is off
                self._fallback(step, "reposition_disabled", st)
                return self._compute(kv, step.token_ids, step.position, st)
            st.computed += res.recomputed_tokens
            st.reused += step.tokens - res.recomputed_tokens
            return KVCache.cat([kv, res.kv])
        raise ValueError(f"unknown plan step kind {k}")

    # ---- shipping ---------------------------------------------------------------------------
    def execute(self, plan: RequestPlan, decode_address: str, transfer_id: str,
                store_context_as: str | None = None) -> PrefillResult:
        """Build the prefix, optionally store it in the tier (a session's context for the next
        turn), and push it to ``decode_address``. A failed push is reported (``transferred``
        False + a fallback reason), never raised: the decode worker then recomputes."""
        t = time.perf_counter()
        kv, st = self.build(plan)
        built = time.perf_counter() - t
        if store_context_as is not None and kv.num_tokens:
            self.source.put_kv(store_context_as, kv)
        sent, tsec, ok = 0, 0.0, True
        try:
            receipt = self.transport.send(decode_address, encode_block(transfer_id, plan.model, kv),
                                          timeout=self.transfer_timeout)
            sent, tsec = receipt.bytes_sent, receipt.seconds
        except TransferError as exc:
            ok = False
            st.fallbacks.append(f"kv_transfer_{exc.reason}")
            log.warning("KV transfer %s failed (%s): decode worker will recompute", transfer_id, exc)
        return PrefillResult(plan.request_id, transfer_id, kv.num_tokens, built, sent, tsec, st, ok)
