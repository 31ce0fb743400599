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

import threading
from contextlib import contextmanager

import torch

from kvruntime.kv import KVCache
from kvruntime.ops.probes import question_layers

_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def _install() -> None:
    """Wrap transformers' "sdpa" attention once, process-wide: unchanged output; when the calling
    thread is recording (``_recording``) and the module is one of the recorded layers, it also
    accumulates the attention probabilities per key slot. Idle cost: one attribute lookup."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from transformers.modeling_utils import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def scored_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
            out = sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
            rec = getattr(_local, "rec", None)
            if rec is not None and id(module) in rec["modules"]:
                k = key.float()
                if k.shape[1] != query.shape[1]:
                    k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
                scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
                w = (query.float() @ k.transpose(-1, -2)) * scale          # [1, H, q, N]
                if attention_mask is not None:
                    w = w + attention_mask[..., : k.shape[-2]].float()
                p = torch.softmax(w, dim=-1).mean(dim=(0, 1, 2))           # [N]
                rec["sum"] = p if rec["sum"] is None else rec["sum"] + p
                rec["n"] += 1
            return out
        AttentionInterface.register("sdpa", scored_sdpa)
        _installed = True


@contextmanager
def _recording(engine, layers):
    _install()
    attn = [engine.model.model.layers[i].self_attn for i in layers]
    rec = {"modules": {id(a) for a in attn}, "sum": None, "n": 0}
    _local.rec = rec
    try:
        yield rec
    finally:
        _local.rec = None


def question_scores(engine, kv: KVCache, text_ids: list[int], layers) -> torch.Tensor:
    """[kv.num_tokens] float32: the mean attention probability the tokens ``text_ids`` (placed right
    after ``kv``) pay to each slot of ``kv``, averaged over ``layers``, heads and text tokens."""
    if not text_ids:
        raise ValueError("question-guided selection needs a non-empty text after the chunks")
    if getattr(engine.model.config, "_attn_implementation", "sdpa") != "sdpa":
        raise ValueError("question-guided selection needs the engine's sdpa attention")
    start = int(kv.positions.max()) + 1 if kv.num_tokens else 0
    with _recording(engine, layers) as rec:
        engine.prefill(text_ids, torch.arange(start, start + len(text_ids)), kv)
    if rec["n"] != len(layers):
        raise RuntimeError(f"recorded {rec['n']} of {len(layers)} layers (attention not routed through sdpa)")
    return (rec["sum"] / rec["n"])[: kv.num_tokens].to(kv.positions.device)


def question_recompute(engine, kv: KVCache, start: int, ratio: float, text_ids: list[int], *,
                       seam_slots=(), probe: str = "qlast", in_place: bool = False):
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
        s = question_scores(engine, kv, text_ids, layers)[start:]
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
