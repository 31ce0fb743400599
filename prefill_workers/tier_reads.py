"""The prefill worker's view of the KV tier: content references in, KV out.

A plan names KV by content (:class:`~kvruntime.messages.plan.KVRef`); with this worker's model,
KV dtype and RoPE fingerprint that is exactly one :class:`~kvruntime.messages.keys.ChunkKey`
(``kvtransport.tier.store.key_for``). No name map is kept: any prefill actor finds any chunk its tiers
hold, after a restart too (``fs://``, ``lm://``). A registered chunk missing from this worker's
tiers (evicted, or never loaded on this node) is *re-warmed*: precompiled at its canonical
position and stored back, counted by the caller. A chunk planned as exact reuse after a frame
(``KVRef.prefix``) is compiled after that frame on its first use (``variants_compiled``); the
planner's frame variant is the chat frame + the first chunk compiled together from position 0
(``prefix=()``): the whole prefill is stored, frame slots included, so the frame is served from
the tier, never computed again.
"""
from __future__ import annotations

import time

from kvruntime.kv import KVCache
from kvruntime.messages.keys import ChunkKey
from kvruntime.messages.plan import KVRef
from kvruntime.messages.prefill import PrecompileInfo
from kvtransport.tier.store import KVStore, key_for


class PrefillTier:
    def __init__(self, store: KVStore, engine, worker: str = "prefill"):
        self.store, self.engine, self.worker = store, engine, worker
        self.variants_compiled = 0          # chunks compiled after a frame (ref.prefix): worker metrics

    def key(self, ref: KVRef) -> ChunkKey:
        return key_for(self.engine, ref)

    def contains(self, refs: list[KVRef]) -> list[bool]:
        """One bounded tier lookup per ref (copies nothing)."""
        return self.store.contains_many([self.key(r) for r in refs])

    def get(self, ref: KVRef) -> KVCache | None:
        return self.store.get(self.key(ref))

    def put(self, ref: KVRef, kv: KVCache) -> int:
        """Store ``kv`` (its slots must sit at ``ref.position`` onwards); returns bytes."""
        return self.store.put(self.key(ref), kv)

    def evict(self, ref: KVRef) -> bool:
        return self.store.evict(self.key(ref))

    def compile(self, ref: KVRef) -> KVCache:
        """Prefill ``ref``'s tokens after its compile prefix (``ref.prefix``; None: BOS alone; ():
        nothing, from position 0), whose slots are dropped, and store the result; a ref at
        position 0 without a prefix is a stored context (a prompt's prefix, its first token at
        position 0). Only exact chunks can be compiled from tokens alone."""
        from kvruntime.ops import precompile_chunk

        if not ref.exact:
            raise ValueError("approximate KV cannot be recompiled from its tokens alone")
        context = ref.position == 0 and ref.prefix is None     # a prompt's prefix (a stored context): from position 0
        want = (0 if self.engine.bos_id is None else 1) if ref.prefix is None else len(ref.prefix)
        if ref.position != want and not context:
            raise ValueError(f"a chunk compiles at canonical position {want}, the ref says {ref.position}")
        kv = precompile_chunk(self.engine, list(ref.token_ids), [] if context else
                              None if ref.prefix is None else list(ref.prefix))
        self.put(ref, kv)
        self.variants_compiled += ref.prefix is not None
        return kv

    def precompile(self, ref: KVRef, base: KVRef | None = None) -> PrecompileInfo:
        """Idempotent by content: a chunk the tiers already hold is not prefilled again. ``base``:
        an exact stored prefix of the prompt ``ref``: only the rest is computed, after its KV
        (``prefill_workers.store_delta``); from position 0 when the tiers no longer hold it."""
        if self.store.contains(self.key(ref)):
            return PrecompileInfo(True, 0, 0.0, self.worker)
        t = time.perf_counter()
        base_kv = self.get(base) if base is not None else None
        if base_kv is not None:
            from prefill_workers.store_delta import continued
            kv = continued(self.engine, ref, base, base_kv)
            self.put(ref, kv)
        else:
            kv = self.compile(ref)
        return PrecompileInfo(False, kv.nbytes, time.perf_counter() - t, self.worker,
                              len(base.token_ids) if base_kv is not None else 0)
