"""The one builder of a request's KV: what ``compose`` (the fidelity harness, ``kvnotes
calibrate``, the demo, the benches) and the prefill executor (what is served) both run, through
the one interpreter of their steps (:mod:`kvruntime.ops.interpret`).

A :class:`Builder` owns ONE buffer of the context's final size ([layers, 2, kv_heads, capacity,
head_dim], allocated at the first write, in a transport's registered memory when ``alloc`` has
room) and writes every slot once, left to right:

- :meth:`append`: loaded KV (exact reuse, a tier hit) copied into its slots;
- :meth:`reposition`: a chunk's keys re-rotated straight into its slots (values copied);
- :meth:`compute`: text (an erratum, a question, a recomputed step, a prefill chunk) run through
  the model, each layer writing its K/V into its slots and attending to the slots before them;
- :meth:`mark_seams` + :meth:`flush`: the pending chunks' seam repair or selective recompute in
  ONE forward whose K/V are written in place into the seam and selected slots.

Nothing is concatenated and the context is never copied (``engine.write``).
"""
from __future__ import annotations

import torch

from kvruntime.kv import KVBuffer, KVCache


class Builder:
    def __init__(self, engine, capacity: int, *, alloc=None, cancelled=None):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.engine, self.capacity = engine, capacity
        self.alloc, self.cancelled = alloc, cancelled
        self.buf: KVBuffer | None = None
        self.pool_misses = 0
        self.seams: list[int] = []          # chunk starts whose seams are not repaired yet

    # ---- the buffer ------------------------------------------------------------------------
    def buffer(self) -> KVBuffer:
        if self.buf is None:
            e = self.engine
            shape = (e.num_layers, 2, e.kv_heads, self.capacity, e.head_dim)
            data = None
            if self.alloc is not None and e.device.type == "cpu":
                data = self.alloc(shape, e.dtype)
                self.pool_misses += data is None
            self.buf = KVBuffer(data if data is not None else torch.empty(shape, dtype=e.dtype, device=e.device))
        return self.buf

    @property
    def length(self) -> int:
        return 0 if self.buf is None else self.buf.length

    @property
    def kv(self) -> KVCache:
        """The slots written so far (views of the buffer)."""
        return self.engine.empty_kv() if self.buf is None else self.buf.view()

    @property
    def cursor(self) -> int:
        """The position after the last slot written."""
        return int(self.buf.positions[self.buf.length - 1]) + 1 if self.length else 0

    # ---- writes ------------------------------------------------------------------------------
    def append(self, part: KVCache) -> KVCache:
        """``part``'s slots copied after those written (cast to the engine's dtype as written)."""
        if not part.num_tokens:
            return self.kv
        return self.buffer().append(part)

    def reposition(self, chunk: KVCache, delta: int) -> KVCache:
        """``chunk`` moved by ``delta`` positions, its keys re-rotated straight into its slots."""
        from kvruntime.ops.slots import reposition
        buf = self.buffer()
        src = chunk.to(self.engine.device)
        moved = reposition(self.engine.rope, src, delta, out=buf.slot(chunk.num_tokens))
        return buf.commit(moved.positions, moved.token_ids)

    def compute(self, token_ids, position: int | None = None, *, logits: bool = False):
        """Run ``token_ids`` at ``position``.. (default: the cursor) after the slots written,
        in place; returns the last token's logits when ``logits``."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        q = ids.numel()
        if q == 0:
            raise ValueError("nothing to compute")
        start = self.cursor if position is None else int(position)
        buf = self.buffer()
        buf.slot(q)
        n = buf.length
        pos = torch.arange(start, start + q, device=buf.positions.device)
        buf.positions[n:n + q] = pos
        buf.token_ids[n:n + q] = ids.to(buf.token_ids.device)
        out = self.engine.write(buf.data, buf.positions, buf.token_ids, slice(n, n + q), n + q,
                                logits=logits, cancelled=self.cancelled)
        buf.length = n + q
        return out

    # ---- seams and selective recompute -------------------------------------------------------
    def mark_seam(self) -> None:
        """The next slot written starts a chunk whose seam is repaired at :meth:`flush`."""
        self.seams.append(self.length)

    def flush(self, seam_tokens: int = 1, ratio: float = 0.0, probe: str = "kv1", question=None,
              probe_cache: dict | None = None):
        """Repair the pending chunks' seams (their first ``seam_tokens`` slots) in one forward,
        written in place; with ``ratio`` > 0 also recompute the top-``ratio`` chunk tokens in the
        same forward, ranked by ``probe`` (``kv<N>``/``progressive``: ``ops.blend``; ``q...``:
        ``ops.qselect``, ranked by ``question``, the text that follows). Returns the
        ``blend.BlendResult`` (None when nothing was pending)."""
        from kvruntime.ops.blend import BlendResult, selective_recompute
        from kvruntime.ops.slots import seam_repair
        from kvruntime.ops.probes import is_question_probe
        pending, self.seams = self.seams, []
        if not pending:
            return None
        kv = self.kv
        seams = sorted({i for s in pending for i in range(s, min(s + seam_tokens, kv.num_tokens))})
        if ratio <= 0:
            seam_repair(self.engine, kv, pending, seam_tokens, in_place=True, cancelled=self.cancelled)
            return BlendResult(kv, seams, 0, 0)
        if is_question_probe(probe):
            from kvruntime.ops.qselect import question_recompute
            if not question:
                raise ValueError(f"probe {probe!r} needs text after the chunks to rank them by")
            return question_recompute(self.engine, kv, pending[0], ratio, list(question), seam_slots=seams,
                                      probe=probe, in_place=True, room=self.buf)
        return selective_recompute(self.engine, kv, pending[0], ratio, seam_slots=seams, probe=probe,
                                   in_place=True, probe_cache=probe_cache)
