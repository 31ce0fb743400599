"""Selective recompute of composed chunks (CacheBlend's idea on the reference engine).

After chunks are repositioned and spliced (and their seams repaired), most of their KV is close
to what a full prefill of the whole context would give, but some tokens deviate a lot: the ones
whose meaning depends on what came before the chunk. :func:`selective_recompute` finds them
with a cheap probe and recomputes only those against the whole context in every layer.

Probes (``probe=``; measured against each other in docs/fidelity.md):

- ``"kv1"`` (default): every chunk token is re-run through layer 0 and layer 1's K/V projection
  only, attending to the whole context; the KV deviation at layer 1 (sum of squared key and value
  differences) ranks them. Layer 0 cannot see the context (its KV depends on token and position
  only). Cost ~1 layer per chunk token (the forward stops once layer 1 has its K/V).
- ``"kv<N>"`` (e.g. ``"kv4"``): the same at layer N (costs ~N layers per chunk token).
- ``"progressive"``: CacheBlend's gradual filtering. Rank by layer 1 as ``kv1``, keep the top
  3k (k = the tokens to recompute), recompute those through layers 0..2 against the cached rest
  and re-rank by their layer-2 deviation, keep 2k, do the same at layer 3, keep k.

The chosen tokens, plus the seam tokens, are then recomputed in ONE forward through all layers:
each attends by position to the cached slots and to the other recomputed tokens' fresh KV, so
``ratio=1`` is a full recompute of the chunks and ``ratio=0`` is exactly reposition + seam repair.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kvruntime.kv import KVCache

PROGRESSIVE_STEPS = ((2, 2), (3, 1))   # (layer, keep multiple of k) after the layer-1 top-3k
PROGRESSIVE_FIRST = 3
# a probe over many tokens runs them in query chunks of this many: one-shot, D queries against
# P + D keys materialise [heads, D, P + D] scores and a [D, P + D] float mask per layer (GBs at 8k)
PROBE_CHUNK = 512


@dataclass(frozen=True)
class BlendResult:
    kv: KVCache                 # the context with the selected slots recomputed
    recomputed_slots: list[int]  # slot indices recomputed through every layer (seams included)
    probed_tokens: int          # chunk tokens run through the probe's first layers to rank them
    probe_token_layers: int = 0  # probe cost: tokens x full layers run (+ the last layer's K/V projection)


def blend_count(ratio: float, candidates: int) -> int:
    """How many of ``candidates`` chunk tokens a ``ratio`` recomputes (rounded up)."""
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio!r}")
    return min(candidates, math.ceil(ratio * candidates - 1e-9))


def probe_layer_of(probe: str, num_layers: int) -> int | None:
    """The deviation layer of a ``kv<N>`` probe, None for ``progressive`` and for the
    question-guided probes of :mod:`kvruntime.ops.qselect`; ValueError otherwise."""
    from kvruntime.ops.probes import is_question_probe, question_layers
    if is_question_probe(probe):
        question_layers(probe, num_layers)
        return None
    if probe == "progressive":
        if num_layers < 5:
            raise ValueError("the progressive probe needs a model of >= 5 layers")
        return None
    m = re.fullmatch(r"kv(\d+)", probe or "")
    if not m:
        raise ValueError(f"probe must be 'kv<N>' (e.g. 'kv1'), 'progressive' or 'q<last|late|N>[-g<k>]', got {probe!r}")
    layer = int(m.group(1))
    if not 1 <= layer < num_layers - 1:
        raise ValueError(f"probe layer must be in [1, {num_layers - 2}], got {layer}")
    return layer


def _dev(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token squared KV distance of two [2, heads, tokens, dim] layer slices -> [tokens]."""
    return ((a - b).float() ** 2).sum(dim=(0, 1, 3))


def _layer_kv(engine, token_ids, positions, past: KVCache, layer: int, *,
              all_layers: bool = False) -> torch.Tensor:
    """K/V ([2, kv_heads, n, head_dim]) that ``layer`` computes for the new tokens attending to
    ``past`` + themselves. The forward stops as soon as that layer has projected (and rotated)
    its keys and values (``engine.write(stop_layer=)``): the layer's attention and MLP, and every
    later layer, never run. ``all_layers=True``: layers 0..``layer``'s K/V ([layer+1, 2,
    kv_heads, n, head_dim]). Only layers 0..``layer`` of ``past`` are copied, into a scratch
    buffer of those layers (the probe must not overwrite the cached KV it is compared with)."""
    dev = engine.device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
    pos = torch.as_tensor(positions, dtype=torch.long, device=dev)
    p, n = past.num_tokens, ids.numel()
    buf = torch.zeros(layer + 1, 2, engine.kv_heads, p + n, engine.head_dim, dtype=engine.dtype, device=dev)
    buf[:, :, :, :p] = past.data[:layer + 1]
    all_pos = torch.cat([past.positions.to(dev), pos])      # [P] int64 positions, not KV
    all_ids = torch.cat([past.token_ids.to(dev), ids])
    engine.write(buf, all_pos, all_ids, slice(p, p + n), p + n, stop_layer=layer)
    if all_layers:
        return buf[:, :, :, p:]
    return buf[layer, :, :, p:]


def probe_kv(engine, token_ids, positions, past: KVCache, layer: int, *,
             chunk: int | None = None) -> torch.Tensor:
    """K/V ([2, kv_heads, n, head_dim]) that ``layer`` computes for the new tokens attending to
    ``past`` + themselves (as :func:`_layer_kv`), run in query chunks of ``chunk`` tokens
    (default :data:`PROBE_CHUNK`): chunk i attends to ``past`` and to the fresh layer-0..``layer``
    K/V of chunks < i, which is the one-shot probe up to float rounding. Only layers
    0..``layer`` of ``past`` are copied. Cost: O(n * (P + n) * layer) attention, memory
    O(chunk * (P + n)) per layer instead of O(n * (P + n))."""
    chunk = PROBE_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"probe chunk must be >= 1 token, got {chunk}")
    dev = engine.device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
    pos = torch.as_tensor(positions, dtype=torch.long, device=dev)
    n, p = ids.numel(), past.num_tokens
    if n == 0:
        raise ValueError("probe needs at least one token")
    buf = torch.zeros(layer + 1, 2, engine.kv_heads, p + n, engine.head_dim, dtype=engine.dtype, device=dev)
    buf[:, :, :, :p] = past.data[:layer + 1]
    all_pos = torch.cat([past.positions.to(dev), pos])
    all_ids = torch.cat([past.token_ids.to(dev), ids])
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        engine.write(buf, all_pos, all_ids, slice(p + s, p + e), p + e, stop_layer=layer)
    return buf[layer, :, :, p:]


def _probe_all(engine, kv: KVCache, start: int, layer: int) -> torch.Tensor:
    """Deviation at ``layer`` of every slot in [start, n) re-run through layers 0..layer."""
    tail = kv.slice(start)
    fresh = probe_kv(engine, tail.token_ids, tail.positions, kv.slice(0, start), layer)
    return _dev(fresh, tail.data[layer])


def _refine(engine, kv: KVCache, slots: list[int], layer: int) -> torch.Tensor:
    """Deviation at ``layer`` of ``slots`` recomputed through layers 0..layer against the rest."""
    dev = kv.positions.device
    idx = torch.tensor(slots, dtype=torch.long, device=dev)
    keep = torch.ones(kv.num_tokens, dtype=torch.bool, device=dev)
    keep[idx] = False
    fresh = _layer_kv(engine, kv.token_ids[idx], kv.positions[idx], kv.select(torch.nonzero(keep).flatten()), layer)
    return _dev(fresh, kv.data[layer].index_select(2, idx))


def choose_slots(engine, kv: KVCache, start: int, cand: list[int], k: int, probe: str = "kv1",
                 cache: dict | None = None) -> tuple[list[int], int]:
    """The ``k`` of ``cand`` (absolute slots >= start) the probe ranks highest, and the probe's
    cost in token-layers. ``cache`` (a dict the caller keeps per context) memoises the first-layer
    ranking, so a sweep over ratios probes once."""
    layer = probe_layer_of(probe, engine.num_layers)
    first = layer if layer is not None else 1
    key = (start, kv.num_tokens, first)
    cost = 0
    if cache is not None and key in cache:
        d = cache[key]
    else:
        d = _probe_all(engine, kv, start, first)
        cost = (kv.num_tokens - start) * first
        if cache is not None:
            cache[key] = d
    c_idx = torch.tensor(cand, dtype=torch.long, device=d.device) - start
    if layer is not None:
        top = torch.topk(d[c_idx], k).indices
        return sorted(int(c_idx[i]) + start for i in top), cost
    keep = min(len(cand), PROGRESSIVE_FIRST * k)
    sel = [int(c_idx[i]) + start for i in torch.topk(d[c_idx], keep).indices]
    for lyr, mult in PROGRESSIVE_STEPS:
        n_keep = min(len(sel), mult * k)
        if n_keep == len(sel):
            continue
        dl = _refine(engine, kv, sorted(sel), lyr)
        cost += len(sel) * lyr
        order = sorted(sel)
        sel = [order[i] for i in torch.topk(dl, n_keep).indices.tolist()]
    return sorted(sel), cost


def selective_recompute(engine, kv: KVCache, start: int, ratio: float, *, seam_slots=(),
                        probe: str = "kv1", in_place: bool = False, probe_cache: dict | None = None
                        ) -> BlendResult:
    """Recompute the ``ratio`` share of slots ``[start, kv.num_tokens)`` (the composed chunks)
    whose KV deviates most from the whole-context KV (ranked by ``probe``), plus ``seam_slots``
    (absolute slot indices in that range, always recomputed), against every other slot of ``kv``.
    ``in_place=True`` writes the fresh KV into ``kv.data`` (the caller owns that buffer) instead
    of copying it first.

    Cost: ``kv1``: O(T * P * 2 layers) for the probe over T chunk tokens attending to P slots,
    plus O((r*T + seams) * P * L) for the recompute; no probe when ``ratio`` is 0 or 1.
    """
    n = kv.num_tokens
    if not 0 <= start <= n:
        raise ValueError(f"chunk start {start} outside the cache of {n} slots")
    probe_layer_of(probe, engine.num_layers)          # validates the probe
    from kvruntime.ops.probes import is_question_probe
    if is_question_probe(probe):
        raise ValueError(f"probe {probe!r} ranks by the question: use qselect.question_recompute")
    seams = sorted({int(s) for s in seam_slots})
    if any(not start <= s < n for s in seams):
        raise ValueError("seam slots must lie in the chunk range")
    seam_set = set(seams)
    cand = [i for i in range(start, n) if i not in seam_set]
    k = blend_count(ratio, len(cand))
    probed = cost = 0
    if k == len(cand):
        chosen = cand
    elif k == 0:
        chosen = []
    else:
        chosen, cost = choose_slots(engine, kv, start, cand, k, probe, probe_cache)
        probed = n - start
    slots = sorted(set(chosen) | seam_set)
    return BlendResult(recompute_slots(engine, kv, slots, in_place=in_place), slots, probed, cost)


def recompute_slots(engine, kv: KVCache, slots: list[int], *, in_place: bool = False) -> KVCache:
    """``kv`` with ``slots`` (sorted slot indices) recomputed through every layer in ONE forward,
    attending by position to every other slot's cached KV and to each other's fresh KV, written
    into ``kv.data`` (``in_place``; the caller owns it) or into one copy of it.
    Cost: O(len(slots) * P * L)."""
    from kvruntime.ops.slots import write_slots
    if not slots:
        return kv
    data = kv.data if in_place else kv.data.clone()
    out = KVCache(data, kv.positions, kv.token_ids)
    write_slots(engine, out, sorted(slots))
    return out
