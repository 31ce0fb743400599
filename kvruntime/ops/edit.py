"""Editing cached notes: erratum (append a correction) and edit-in-place (recompute the field
and the top-K downstream tokens it most affects)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvruntime.errata import DEFAULT_ERRATUM_STYLE, erratum_text
from kvruntime.kv import KVCache
from kvruntime.ops.blend import probe_kv, recompute_slots
from kvruntime.ops.compose import reposition


@dataclass(frozen=True)
class ErratumResult:
    text: str                  # the correction sentence appended
    token_ids: list[int]       # its tokens
    kv: KVCache                # old context (reused whole) + the erratum's KV
    logits: torch.Tensor       # [vocab] after the erratum


def erratum(engine, old_context: KVCache, label: str, old: str | None, new: str, *,
            style: str = DEFAULT_ERRATUM_STYLE) -> ErratumResult:
    """Append "Correction: the <label> is now <new>." after the cached ``old_context`` (reused
    whole, nothing recomputed). Cost: O(e * P * L) for an e-token erratum."""
    text = erratum_text(label, new, old=old, style=style)
    ids = engine.encode(text)
    start = int(old_context.positions.max()) + 1 if old_context.num_tokens else 0
    out = engine.prefill(ids, torch.arange(start, start + len(ids)), old_context, logits=True)
    return ErratumResult(text, ids, KVCache.cat([old_context, out.kv]), out.logits)


@dataclass(frozen=True)
class EditResult:
    kv: KVCache                # edited context, slots in position order
    recomputed_tokens: int     # field tokens + selected downstream tokens (full forward)
    probed_tokens: int         # downstream tokens run through the first probe_layer+1 layers
    selected_slots: list[int]  # slot indices (in the edited cache) recomputed downstream


def edit_in_place(engine, cached: KVCache, field_span: tuple[int, int], new_tokens: list[int],
                  top_k: int, *, probe_layer: int = 1, probe_chunk: int | None = None) -> EditResult:
    """Replace slots ``[a, b)`` of ``cached`` (the field's old tokens) by ``new_tokens``.

    1. The field is recomputed in context (prefix + new field); downstream slots are
       re-rotated if the field's length changed.
    2. Selection signal (as in CacheBlend): all downstream tokens are re-run through layers
       0..``probe_layer`` only; the ``top_k`` with the largest KV deviation at ``probe_layer``
       (sum of squared key and value differences) are chosen. Layer 0 cannot see the edit
       (its KV depends only on the token and position), so the probe starts at layer 1.
       The probe stops once layer ``probe_layer`` has its K/V and runs the downstream tokens in
       query chunks of ``probe_chunk`` (default ``blend.PROBE_CHUNK``): one-shot, D queries x
       (P + D) keys would materialise GBs of scores and mask per layer at 8k.
    3. The chosen tokens are recomputed through all layers attending to the prefix, the new
       field and every downstream slot at or before their position (cached or fresh).
    Cost: O(f * P * L) for f field tokens + O(D * P * probe_layer) probe + O(K * P * L).
    ``top_k == 0`` is "field only".
    """
    a, b = field_span
    if not 0 <= a <= b <= cached.num_tokens:
        raise ValueError(f"field span {field_span} outside the cache of {cached.num_tokens} slots")
    if not new_tokens:
        raise ValueError("new field value has no tokens")
    if top_k < 0:
        raise ValueError("top_k must be >= 0")
    if not 0 <= probe_layer < engine.num_layers:
        raise ValueError(f"probe_layer must be in [0, {engine.num_layers - 1}], got {probe_layer}")
    prefix, down = cached.slice(0, a), cached.slice(b)
    start = int(cached.positions[a]) if a < cached.num_tokens else (int(cached.positions[-1]) + 1 if a else 0)
    field = engine.prefill(new_tokens, torch.arange(start, start + len(new_tokens)), prefix).kv
    delta = len(new_tokens) - (b - a)
    if delta and down.num_tokens:
        down = reposition(engine.rope, down, delta)
    head = KVCache.cat([prefix, field])
    k = min(top_k, down.num_tokens)
    if k == 0:
        return EditResult(KVCache.cat([head, down]), len(new_tokens), 0, [])
    probe = probe_kv(engine, down.token_ids, down.positions, head, probe_layer, chunk=probe_chunk)
    dev = ((probe - down.data[probe_layer]).float() ** 2).sum(dim=(0, 1, 3))  # [D]
    chosen = torch.topk(dev, k).indices.sort().values
    slots = [head.num_tokens + int(i) for i in chosen]
    # the chosen slots attend to head + the other downstream slots (cached) + each other (fresh);
    # written into the one new buffer of the edited context
    edited = recompute_slots(engine, KVCache.cat([head, down]), slots, in_place=True)
    return EditResult(edited, len(new_tokens) + k, down.num_tokens, slots)
