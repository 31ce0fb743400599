"""In-place writes into a request's KV: re-rotation into slots, seam repair and the recompute of
given slots (``engine.write``). Imports nothing else from ``kvruntime.ops`` (the builder, compose
and blend all use it)."""
from __future__ import annotations

import torch

from kvruntime.kv import KVCache


def reposition(rope, chunk: KVCache, delta: int | torch.Tensor, out: torch.Tensor | None = None) -> KVCache:
    """Move ``chunk`` by ``delta`` positions: keys re-rotated, values untouched (copied), written
    into ``out`` ([layers, 2, kv_heads, n, head_dim], e.g. the tail of the buffer that is shipped;
    None: a new tensor). Cost: one pass over the KV, no forward pass. Raises
    ``RepositionDisabled`` when the startup self-test failed."""
    if out is None:
        out = torch.empty(chunk.data.shape, dtype=chunk.data.dtype, device=chunk.data.device)
    rope.rotate(chunk.keys, delta, out=out[:, 0])
    out[:, 1].copy_(chunk.values)
    return KVCache(out, chunk.positions + torch.as_tensor(delta, device=chunk.positions.device), chunk.token_ids)


def seam_repair(engine, composed: KVCache, chunk_starts: list[int], k: int = 1, *,
                in_place: bool = False, cancelled=None) -> KVCache:
    """Recompute the first ``k`` slots of each chunk starting at slot ``chunk_starts[i]`` in the
    context of everything before it.

    All seam slots go through ONE forward (``engine.write``): each layer writes the seams' fresh
    K/V into their slots and each seam attends (by position) to the cached slots before it and
    to the earlier seams' fresh KV, which is exactly what repairing the chunks one after another
    left to right would give. Cost: one forward of (chunks * k) tokens attending to the slots up
    to the last seam, O(chunks * k * P * L); nothing of the context is copied.
    ``in_place=True`` writes into ``composed.data`` (the caller owns that buffer, in the engine's
    dtype); else into one copy of it.
    """
    if k <= 0 or not chunk_starts:
        return composed
    seams: list[int] = []
    for s in sorted(set(chunk_starts)):
        if not 0 <= s < composed.num_tokens:
            raise ValueError(f"chunk start {s} outside the composed cache of {composed.num_tokens} slots")
        seams += [i for i in range(s, min(s + k, composed.num_tokens)) if not seams or i > seams[-1]]
    data = composed.data if in_place else composed.data.clone()
    write_slots(engine, KVCache(data, composed.positions, composed.token_ids), seams, cancelled=cancelled)
    return KVCache(data, composed.positions, composed.token_ids)


def write_slots(engine, kv: KVCache, slots: list[int], *, cancelled=None) -> None:
    """Recompute ``slots`` (sorted slot indices) of ``kv`` through every layer in ONE forward,
    written in place into ``kv.data``: each attends by position to every other slot's cached KV
    and to the others' fresh KV. Keys past the last slot are not read when the slots are in
    position order (they are masked anyway). Cost: O(len(slots) * P * L)."""
    if not slots:
        return
    if kv.data.dtype != engine.dtype or kv.data.device != engine.device:
        raise ValueError("KV written in place must be in the engine's dtype and device")
    keys = slots[-1] + 1 if kv.is_position_ordered() else kv.num_tokens
    idx = torch.tensor(slots, dtype=torch.long, device=engine.device)
    engine.write(kv.data, kv.positions, kv.token_ids, idx, keys, cancelled=cancelled)
