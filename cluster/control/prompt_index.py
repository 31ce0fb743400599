"""The prompt-prefix index: which token prefixes (per tenant) an earlier request stored in the
tier, kept in the state store (``put_prompt_blocks`` / ``get_prompt_blocks``) as hashes of the
prefix at each block boundary. It is a cache: a state store that does not answer plans as a miss
(``kvnotes_fallbacks_total{reason="prompt_index_unavailable"}``), and an indexed prefix the tier
has evicted since is checked for before it is reused.

Public functions (stable; prompt matching extends them): :data:`PROMPT_BLOCK`,
:func:`prompt_hash`, :func:`block_bounds`, and :class:`PromptIndex` with ``indexed``,
``record``, ``longest_held``, ``held_whole``.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING

from cluster.control.metrics import Metrics
from cluster.control.state import StateStore, StateStoreUnavailable
from kvruntime.messages.plan import KVRef

if TYPE_CHECKING:
    from cluster.control.lifecycle import StageClock
    from cluster.control.tier_lookup import TierLookup

log = logging.getLogger(__name__)
# Plain-prompt prefix reuse granularity (tokens). Equal to the tier's LMCache piece size
# (kvruntime.config.tier.TierConfig.chunk_size; `kvnotes serve` refuses another): a stored prompt
# serves every prefix of it that ends on a piece boundary, so the index records exactly those
# boundaries (and the whole prefix).
PROMPT_BLOCK = 256


def prompt_hash(tenant: str, ids) -> str:
    """The index key of one tenant's token prefix (32 hex characters)."""
    return hashlib.sha256((tenant + "|" + ",".join(map(str, ids))).encode()).hexdigest()[:32]


def block_bounds(n: int) -> list[int]:
    """Prefix lengths the index records for an ``n``-token prefix, longest first: every
    PROMPT_BLOCK boundary and ``n`` itself (only ``n`` below one block; none for 0)."""
    if n < PROMPT_BLOCK:
        return [n] if n else []
    return sorted({*range(PROMPT_BLOCK, n + 1, PROMPT_BLOCK), n}, reverse=True)


class PromptIndex:
    def __init__(self, state: StateStore, metrics: Metrics, lookup: "TierLookup"):
        self.state, self.metrics, self.lookup = state, metrics, lookup

    def indexed(self, tenant: str, ids: tuple[int, ...]) -> bool:
        """Whether the whole of ``ids`` is indexed (one hash, no tier lookup)."""
        try:
            return bool(self.state.get_prompt_blocks(tenant, [prompt_hash(tenant, ids)], time.time()))
        except StateStoreUnavailable as exc:        # the index is a cache: plan without it
            self.unavailable(exc)
            return False

    def record(self, tenant: str, prefix: tuple[int, ...]) -> None:
        """Record ``prefix``'s block boundaries (and its length): it is stored in the tier."""
        try:
            self.state.put_prompt_blocks(tenant, {prompt_hash(tenant, prefix[:b]): b for b in block_bounds(len(prefix))},
                                         time.time())
        except StateStoreUnavailable as exc:    # the answer stands; the prefix is just not indexed
            self.unavailable(exc)

    async def held_whole(self, ref: KVRef, index: int, clock: "StageClock | None" = None) -> bool:
        """Whether prefill worker ``index``'s tier holds ``ref`` (one counted lookup)."""
        return ref.digest in await self.lookup.present([ref], index, clock)

    async def longest_held(self, tenant: str, salt: str, prefix: tuple[int, ...], index: int,
                           clock: "StageClock | None" = None, extra: tuple[int, ...] = ()) -> tuple[KVRef | None, int]:
        """Longest indexed prefix of ``prefix`` that the prefill worker's tier still holds. Every
        indexed boundary is checked in one batched lookup; when longer ones were evicted (the
        index outlives the tier's LRU) the longest present one is used, counted as
        ``kvnotes_fallbacks_total{reason="prompt_prefix_evicted"}``. ``extra``: more prefix
        lengths to check (an earlier prompt's exact length: store-behind's base)."""
        bounds = sorted({*block_bounds(len(prefix)), *(k for k in extra if 0 < k <= len(prefix))}, reverse=True)
        hashes = {b: prompt_hash(tenant, prefix[:b]) for b in bounds}
        try:
            known = self.state.get_prompt_blocks(tenant, list(hashes.values()), time.time())
        except StateStoreUnavailable as exc:            # the index is a cache: plan as a miss
            self.unavailable(exc)
            return None, 0
        candidates = [b for b in bounds if hashes[b] in known]                # longest first
        refs = [KVRef(prefix[:b], 0, salt) for b in candidates]
        present = await self.lookup.present(refs, index, clock)
        for b, ref in zip(candidates, refs):
            if ref.digest in present:
                if b != candidates[0]:
                    self.metrics.record_fallback("prompt_prefix_evicted")
                    log.info("prompt prefix of %d tokens no longer in the tier: reusing %d", candidates[0], b)
                return ref, b
        return None, 0

    def unavailable(self, exc: StateStoreUnavailable) -> None:
        self.metrics.record_fallback("prompt_index_unavailable")
        log.warning("prompt index skipped (the prompt is computed, not reused): %s", exc)
