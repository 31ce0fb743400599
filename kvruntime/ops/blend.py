"""Selective recompute of composed chunks (CacheBlend's idea on the reference engine).

After chunks are repositioned and spliced (and their seams repaired), most of their KV is close
to what a full prefill of the whole context would give, but some tokens deviate a lot: the ones
whose meaning depends on what came before the chunk. :func:`selective_recompute` finds them
with a cheap probe and recomputes only those against the whole context in every layer.

Probe (as in edit-in-place): every chunk token is re-run through layers 0..``probe_layer`` only,
attending to the whole context; the KV deviation at ``probe_layer`` (sum of squared key and value
differences) ranks the tokens. Layer 0 cannot see the context (its KV depends on token and
position only), so the probe starts at layer 1. The top ``ratio`` of the chunk tokens, plus the
seam tokens, are then recomputed in ONE forward through all layers: each attends by position to
the cached slots and to the other recomputed tokens' fresh KV, so ``ratio=1`` is a full recompute
of the chunks and ``ratio=0`` is exactly reposition + seam repair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvruntime.kv import KVCache


@dataclass(frozen=True)
class BlendResult:
    kv: KVCache                 # the context with the selected slots recomputed
    recomputed_slots: list[int]  # slot indices recomputed through every layer (seams included)
    probed_tokens: int          # tokens run through layers 0..probe_layer to rank them


def blend_count(ratio: float, candidates: int) -> int:
    """How many of ``candidates`` chunk tokens a ``ratio`` recomputes (rounded up)."""
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio!r}")
    return min(candidates, math.ceil(ratio * candidates - 1e-9))


def selective_recompute(engine, kv: KVCache, start: int, ratio: float, *, seam_slots=(),
                        probe_layer: int = 1) -> BlendResult:
    """Recompute the ``ratio`` share of slots ``[start, kv.num_tokens)`` (the composed chunks)
    whose KV deviates most from the whole-context KV, plus ``seam_slots`` (absolute slot indices
    in that range, always recomputed), against every other slot of ``kv``.

    Cost: O(T * P * (probe_layer + 1)) for the probe over T chunk tokens attending to P slots,
    plus O((r*T + seams) * P * L) for the recompute; no probe when ``ratio`` is 0 or 1.
    """
    n = kv.num_tokens
    if not 0 <= start <= n:
        raise ValueError(f"chunk start {start} outside the cache of {n} slots")
    if not 0 <= probe_layer < engine.num_layers - 1:
        raise ValueError(f"probe_layer must be in [0, {engine.num_layers - 2}]")
    dev = kv.positions.device
    seams = sorted({int(s) for s in seam_slots})
    if any(not start <= s < n for s in seams):
        raise ValueError("seam slots must lie in the chunk range")
    cand = [i for i in range(start, n) if i not in set(seams)]
    k = blend_count(ratio, len(cand))
    probed = 0
    if k == len(cand):
        chosen = cand
    elif k == 0:
        chosen = []
    else:
        tail = kv.slice(start)
        probe = engine.prefill(tail.token_ids, tail.positions, kv.slice(0, start), stop_after_layer=probe_layer).kv
        d = ((probe.data[probe_layer] - tail.data[probe_layer]).float() ** 2).sum(dim=(0, 1, 3))  # [T]
        c_idx = torch.tensor(cand, dtype=torch.long, device=d.device) - start
        top = torch.topk(d[c_idx], k).indices
        chosen = sorted(int(c_idx[i]) + start for i in top)
        probed = tail.num_tokens
    slots = sorted(set(chosen) | set(seams))
    if not slots:
        return BlendResult(kv, [], probed)
    idx = torch.tensor(slots, dtype=torch.long, device=dev)
    keep = torch.ones(n, dtype=torch.bool, device=dev)
    keep[idx] = False
    fresh = engine.prefill(kv.token_ids[idx], kv.positions[idx], kv.select(torch.nonzero(keep).flatten())).kv
    data = kv.data.clone()
    data[:, :, :, idx] = fresh.data.to(data.dtype)
    return BlendResult(KVCache(data, kv.positions, kv.token_ids), slots, probed)
