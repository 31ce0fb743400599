"""Selective recompute picked by the question (FusionRAG / A3 / ProphetKV's idea).

Instead of probing every chunk token's KV deviation (``blend``'s ``kv1``), run the text that
follows the chunks (the question) over the composed, repositioned KV -- the pass a request runs
anyway -- and record how much attention its tokens pay to each chunk slot. The r share of chunk
tokens the question attends to most, plus the seam tokens, are recomputed in ONE forward
(``blend.recompute_slots``); the caller then runs the question again over the repaired context.

Probes (``compose(..., probe=...)``): ``q<layers>[-g<k>]``

- layers: ``last`` (the last layer), ``late`` (mean over the last quarter of layers), or a layer
  index ``N`` (``q1`` is A3's layer-1 variant).
- ``-g<k>``: scores smoothed over +-k neighbouring slots (mean), so a picked token's neighbours
  rank higher too (CacheClip's "grouping"; A3 pools over 5).

Score of slot j = mean over heads and question tokens of softmax(q k^T / sqrt(d) + mask)[j], the
attention probabilities as the model computes them (same mask, GQA heads repeated).
Cost: one forward of the question (q tokens) over P slots, plus q x P x heads per scored layer,
instead of the probe's ~1 layer over every chunk token; then O((r*T + seams) * P * L).
"""
from __future__ import annotations

import torch

from kvruntime.kv import KVCache
from kvruntime.ops.probes import question_layers


def question_scores(engine, kv: KVCache, text_ids: list[int], layers, room=None) -> torch.Tensor:
    """[kv.num_tokens] float32: the mean attention probability the tokens ``text_ids`` (placed right
    after ``kv``) pay to each slot of ``kv``, averaged over ``layers``, heads and text tokens
    (recorded by ``kvruntime.inplace.attend``). ``room``: the ``KVBuffer`` ``kv`` is the written
    part of; when it has room for the text, the text's K/V go into its next slots (not committed:
    the text is run again after the repair) and nothing is copied; else ``kv`` is copied once."""
    from kvruntime.inplace import recording
    if not text_ids:
        raise ValueError("question-guided selection needs a non-empty text after the chunks")
    if engine.arch.attn_softcap:
        raise ValueError("question-guided selection does not score soft-capped attention")
    start = int(kv.positions.max()) + 1 if kv.num_tokens else 0
    q, n = len(text_ids), kv.num_tokens
    attn = [engine.model.model.layers[i].self_attn for i in layers]
    with recording(attn) as rec:
        if room is not None and room.length == n and room.capacity >= n + q:
            room.positions[n:n + q] = torch.arange(start, start + q, device=room.positions.device)
            room.token_ids[n:n + q] = torch.as_tensor(text_ids, dtype=torch.long, device=room.token_ids.device)
            engine.write(room.data, room.positions, room.token_ids, slice(n, n + q), n + q)
        else:
            engine.prefill(text_ids, torch.arange(start, start + q), kv)
    if rec["n"] != len(layers):
        raise RuntimeError(f"recorded {rec['n']} of {len(layers)} layers (attention not routed through kvnotes)")
    return (rec["sum"] / rec["n"])[: kv.num_tokens].to(kv.positions.device)


def question_recompute(engine, kv: KVCache, start: int, ratio: float, text_ids: list[int], *,
                       seam_slots=(), probe: str = "qlast", in_place: bool = False, room=None):
    """Recompute the ``ratio`` share of slots ``[start, kv.num_tokens)`` that ``text_ids`` attends
    to most (``probe``: see the module doc), plus ``seam_slots``, in one forward. Returns a
    ``blend.BlendResult`` whose ``probed_tokens`` is the scoring pass's text tokens."""
    from kvruntime.ops.blend import BlendResult, blend_count, recompute_slots

    n = kv.num_tokens
    if not 0 <= start <= n:
        raise ValueError(f"chunk start {start} outside the cache of {n} slots")
    layers, group = question_layers(probe, engine.num_layers)
    seam_set = {int(s) for s in seam_slots}
    if any(not start <= s < n for s in seam_set):
        raise ValueError("seam slots must lie in the chunk range")
    cand = [i for i in range(start, n) if i not in seam_set]
    k = blend_count(ratio, len(cand))
    probed = 0
    if k == len(cand):
        chosen = cand
    elif k == 0:
        chosen = []
    else:
        s = question_scores(engine, kv, text_ids, layers, room)[start:]
        if group:
            s = torch.nn.functional.avg_pool1d(s[None, None], 2 * group + 1, stride=1, padding=group,
                                               count_include_pad=False)[0, 0]
        c_idx = torch.tensor(cand, dtype=torch.long, device=s.device) - start
        top = torch.topk(s[c_idx], k).indices
        chosen = sorted(int(c_idx[i]) + start for i in top)
        probed = len(text_ids)
    slots = sorted(set(chosen) | seam_set)
    return BlendResult(recompute_slots(engine, kv, slots, in_place=in_place), slots, probed,
                       probed * engine.num_layers)
