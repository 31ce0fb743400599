"""Static shapes for few-token forwards: the new-token count padded to a bucket, the keys read
through a length.

A forward of q <= 64 new tokens (a question, an erratum, seam repair, a decode step) runs as
``bucket_for(q)`` tokens (1, 2, 4, ... 64): every tensor the model sees is shaped by the bucket
and by the buffer, never by q or by the number of cached slots, so one captured graph could serve
every request of a bucket (the CUDA-graph capture itself is not built here: issue 47 item 2).
The request enters through tensors only -- the padded token ids, positions and destination slots,
the key length ``key_len`` (a 0-d tensor) and the index of its last real token.

Pads copy the last real token (its id, position and mask row), so their rows stay finite, and
they never reach the buffer: each layer's write gathers the real rows into the bucket's order
(``src``: pads repeat the last real row) and writes them to ``slots`` (pads repeat the last real
slot), so a slot the pads name receives exactly the real token's K/V -- no slot the request owns
(nor any other) ever holds a pad's K/V. Real tokens attend by position and through ``key_len``
(``[B x span]`` additive mask: key slot < key_len, key position <= query position, sliding
layers within the window): pads' K/V are never among the keys. Logits are taken at the last real
row (``logits_to_keep`` as an index tensor).

``span``: how many buffer slots the attention reads. A graph reads a fixed span (the buffer's
capacity) and relies on the mask alone; slots past the length must then be finite (a buffer
allocated with ``torch.empty`` may hold NaN, and 0 x NaN is NaN). The eager path reads
``span = keys`` (one host read of the length per forward, the same values).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(q: int) -> int | None:
    """The smallest bucket holding ``q`` new tokens, None above the largest (an eager forward)."""
    if q < 1:
        raise ValueError(f"a forward needs >= 1 new token, got {q}")
    return next((b for b in BUCKETS if b >= q), None)


@dataclass(frozen=True)
class PaddedStep:
    """One few-token forward at its bucket's shape (tensors on the engine's device)."""
    bucket: int             # B: the tokens the model runs
    real: int               # q: the request's new tokens (the first q rows)
    ids: torch.Tensor       # [B] token ids; pads repeat the last real id
    pos: torch.Tensor       # [B] positions; pads repeat the last real position
    slots: torch.Tensor     # [B] destination slots; pads repeat the last real slot
    src: torch.Tensor       # [B] row of the new K/V each destination receives (pads -> q - 1)
    key_len: torch.Tensor   # 0-d int64: key slots [0, key_len) are attended
    last: torch.Tensor      # [1] int64: the last real row (its logits are returned)


def pad_step(idx: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, keys: int, bucket: int) -> PaddedStep:
    """``idx``/``ids``/``pos``: the q real tokens' slots, ids and positions ([q], one device)."""
    q = idx.numel()
    if not 1 <= q <= bucket:
        raise ValueError(f"{q} new tokens do not fit bucket {bucket}")
    dev = idx.device
    src = torch.arange(bucket, device=dev).clamp_(max=q - 1)
    return PaddedStep(bucket, q, ids[src], pos[src], idx[src], src,
                      torch.tensor(keys, dtype=torch.long, device=dev), torch.tensor([q - 1], device=dev))


def length_masks(step: PaddedStep, k_pos: torch.Tensor, layer_types, window: int | None, dtype,
                 per_layer: bool):
    """Additive masks [1, 1, B, span] (``k_pos``: [span], the buffer's positions): one tensor, or
    a dict per layer type, as :meth:`ReferenceEngine._mask` gives them."""
    span = k_pos.numel()
    diff = step.pos[:, None] - k_pos[None, :]                        # [B, span]
    inside = torch.arange(span, device=k_pos.device)[None, :] < step.key_len
    causal = inside & (diff >= 0)
    neg = torch.finfo(dtype).min
    masks = {}
    for lt in set(layer_types):
        allowed = causal & (diff < window) if lt == "sliding_attention" else causal
        m = torch.zeros(allowed.shape, dtype=dtype, device=k_pos.device)
        m.masked_fill_(~allowed, neg)
        masks[lt] = m[None, None]
    if len(masks) == 1 and ("full_attention" in masks or not per_layer):
        return next(iter(masks.values()))
    return masks
