"""Editing cached notes: erratum (append a correction) and edit-in-place (recompute the field
and the top-K downstream tokens it most affects)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvruntime.errata import DEFAULT_ERRATUM_STYLE, erratum_text
from kvruntime.kv import KVCache
from kvruntime.ops.blend import probe_kv, recompute_slots
from kvruntime.ops.build import Builder


@dataclass(frozen=True)
class ErratumResult:
    text: str                  # the correction sentence appended
    token_ids: list[int]       # its tokens
    kv: KVCache                # old context (reused whole) + the erratum's KV
    logits: torch.Tensor       # [vocab] after the erratum


def erratum(engine, old_context: KVCache | Builder, label: str, old: str | None, new: str, *,
            style: str = DEFAULT_ERRATUM_STYLE) -> ErratumResult:
    """Append "Correction: the <label> is now <new>." after the cached ``old_context`` (reused
    whole, nothing recomputed). ``old_context``: a :class:`~kvruntime.ops.build.Builder` with
    room for the erratum (the request's buffer: the erratum's K/V are written into its next
    slots, the context is not copied), or a KVCache (copied once into a new buffer).
    Cost: O(e * P * L) for an e-token erratum."""
    text = erratum_text(label, new, old=old, style=style)
    ids = engine.encode(text)
    b = old_context if isinstance(old_context, Builder) else _room_after(engine, old_context, len(ids))
    start = int(b.kv.positions.max()) + 1 if b.length else 0
    logits = b.compute(ids, start, logits=True)
    return ErratumResult(text, ids, b.kv, logits)


def _room_after(engine, kv: KVCache, extra: int) -> Builder:
    """A builder holding ``kv`` (one copy) with room for ``extra`` more slots."""
    b = Builder(engine, kv.num_tokens + extra)
    b.append(kv)
    return b


@dataclass(frozen=True)
class EditResult:
    kv: KVCache                # edited context, slots in position order
    recomputed_tokens: int     # field tokens + selected downstream tokens (full forward)
    probed_tokens: int         # downstream tokens run through the first probe_layer+1 layers
    selected_slots: list[int]  # slot indices (in the edited cache) recomputed downstream


def edit_in_place(engine, cached: KVCache, field_span: tuple[int, int], new_tokens: list[int],
                  top_k: int, *, probe_layer: int = 1, probe_chunk: int | None = None,
                  into: Builder | None = None) -> EditResult:
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
    ``top_k == 0`` is "field only". ``into``: an empty :class:`~kvruntime.ops.build.Builder`
    (the request's buffer, e.g. the prefill executor's) the edited context is written into;
    default a new one of the edited context's size.
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
    delta = len(new_tokens) - (b - a)
    if delta and down.num_tokens and not engine.rope.enabled:
        from kvruntime.rope import RepositionDisabled
        raise RepositionDisabled("the field's length changed and re-rotation is disabled")
    # the edited context is ONE buffer: prefix copied, the field computed into its slots, the
    # downstream slots re-rotated (or copied) into theirs, the chosen ones recomputed in place
    if into is not None and into.length:
        raise ValueError("edit_in_place writes the whole edited context: its builder must be empty")
    out = into if into is not None else Builder(engine, a + len(new_tokens) + down.num_tokens)
    out.append(prefix)
    out.compute(new_tokens, start)
    h = out.length
    if delta and down.num_tokens:
        out.reposition(down, delta)
    else:
        out.append(down)
    edited = out.kv
    h_end = edited.num_tokens
    k = min(top_k, down.num_tokens)
    if k == 0:
        return EditResult(edited, len(new_tokens), 0, [])
    head, moved = edited.slice(0, h), edited.slice(h, h_end)
    probe = probe_kv(engine, moved.token_ids, moved.positions, head, probe_layer, chunk=probe_chunk)
    dev = ((probe - moved.data[probe_layer]).float() ** 2).sum(dim=(0, 1, 3))  # [D]
    chosen = torch.topk(dev, k).indices.sort().values
    slots = [h + int(i) for i in chosen]
    # the chosen slots attend to head + the other downstream slots (cached) + each other (fresh)
    edited = recompute_slots(engine, edited, slots, in_place=True)
    return EditResult(edited, len(new_tokens) + k, down.num_tokens, slots)
