"""Forwards that write their K/V into a request's one buffer and attend to it in place.

A :class:`SlotCache` is the transformers ``Cache`` the engine hands the model: its ``update``
writes the new tokens' keys and values into their slots of ``data`` ([layers, 2, kv_heads,
capacity, head_dim], the request's buffer) and returns views of the slots attended to -- no
``DynamicCache``, no concatenation of the context, nothing copied but the new tokens' own K/V.

:func:`attend` is the attention every layer runs (registered with transformers as
``"kvnotes"``): SDPA with ``enable_gqa`` (no K/V expansion) or, with logit soft-capping (Gemma-2),
the same arithmetic as transformers' eager attention with queries reshaped to
``[kv_heads, group * q, d]`` (no expansion either). Its mask is ``None`` where plain causality
suffices -- a query block at the end of position-ordered slots (lower-right causal; a [q x keys]
boolean mask is built only when q > 1 or a sliding window cuts the keys) -- else the engine's
additive [q x keys] mask by position.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers.cache_utils import Cache

from kvruntime.kv import KVCache

IMPL = "kvnotes"
_local = threading.local()
_registered = False
_lock = threading.Lock()


class Cancelled(Exception):
    """A forward stopped between layers because its ``cancelled()`` check said so
    (re-exported as ``kvruntime.engine.Cancelled``)."""


class StopForward(Exception):
    """Raised by a :class:`SlotCache` once its ``stop_layer`` has written its K/V (a probe)."""


class SlotCache(Cache):
    """The request's buffer as a transformers cache for one forward.

    ``slots``: where the new tokens' K/V go (a ``slice`` or a LongTensor of slot indices);
    ``keys``: every layer attends to slots ``[0, keys)`` (the new ones included, already written).
    ``stop_layer``: raise :class:`StopForward` once that layer has written its K/V.
    ``cancelled``: checked before each layer's write; True raises ``engine.Cancelled``."""

    def __init__(self, data: torch.Tensor, slots, keys: int, *, stop_layer: int | None = None, cancelled=None,
                 src: torch.Tensor | None = None):
        super().__init__(layers=[])
        self.data, self.slots, self.keys = data, slots, keys
        self.stop_layer, self.cancelled = stop_layer, cancelled
        self.src = src      # a padded forward (kvruntime.buckets): row of the new K/V each slot receives

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("forward cancelled")
        lyr = self.data[layer_idx]
        if self.src is not None:
            # pads name the last real slot and receive the last real row: never a pad's own K/V
            lyr[0].index_copy_(1, self.slots, key_states[0].index_select(1, self.src).to(lyr.dtype))
            lyr[1].index_copy_(1, self.slots, value_states[0].index_select(1, self.src).to(lyr.dtype))
        elif isinstance(self.slots, slice):
            lyr[0, :, self.slots].copy_(key_states[0])
            lyr[1, :, self.slots].copy_(value_states[0])
        else:
            lyr[0].index_copy_(1, self.slots, key_states[0].to(lyr.dtype))
            lyr[1].index_copy_(1, self.slots, value_states[0].to(lyr.dtype))
        if layer_idx == self.stop_layer:
            raise StopForward
        return lyr[0, :, :self.keys][None], lyr[1, :, :self.keys][None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.keys, 0

    @property
    def is_compileable(self) -> bool:
        return False


def causal_tail_mask(q: int, n: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [q, n] mask (True = attend) of a query block occupying the last q of n
    position-ordered, contiguous slots: lower-right causal, and within ``window`` if given.
    None when nothing is masked (one query, no window cut)."""
    if q == 1 and (window is None or n <= window):
        return None
    qi = torch.arange(n - q, n, device=device)[:, None]
    kj = torch.arange(n, device=device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= (qi - kj) < window
    return allowed


def _mask_for(module, query, key, attention_mask, sliding_window):
    """(mask, is_causal): the given mask; else plain causality (``is_causal``, no mask) for a
    block that is all the keys, or the [q x keys] lower-right causal mask."""
    if attention_mask is not None:
        return (attention_mask[..., : key.shape[-2]] if attention_mask.dim() == 4 else attention_mask), False
    q, n = query.shape[2], key.shape[2]
    window = sliding_window if sliding_window is not None and n > sliding_window else None
    if q == n and q > 1 and window is None:
        return None, True
    if window is None and q > 1 and query.is_cuda:
        # lower-right causality as a bias object: SDPA then runs the flash kernel (GQA included)
        # with no [q x keys] mask at all; on CPU the same object would only materialize the mask
        return causal_lower_right(q, n), False
    m = causal_tail_mask(q, n, window, query.device)
    return (None if m is None else m[None, None]), False


def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
           softcap: float | None = None, sliding_window: int | None = None, **kwargs):
    """query [1, H, q, d], key/value [1, Hkv, n, d] (views of the buffer) -> ([1, q, H, d], None)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask, causal = _mask_for(module, query, key, attention_mask, sliding_window)
    if isinstance(mask, CausalBias) and (softcap is not None or getattr(_local, "rec", None) is not None):
        mask = mask._materialize(query.device)[None, None]
    if causal and (softcap is not None or getattr(_local, "rec", None) is not None):
        mask, causal = causal_tail_mask(query.shape[2], key.shape[2], None, query.device)[None, None], False
    rec = getattr(_local, "rec", None)
    if rec is not None and id(module) in rec["modules"]:
        _record(rec, query, key, mask, scaling)
    h, hkv = query.shape[1], key.shape[1]
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=causal,
                                             enable_gqa=h != hkv)
        return out.transpose(1, 2).contiguous(), None
    # transformers' eager attention with soft-capping, queries grouped per kv head (no expansion)
    q, g = query.shape[2], h // hkv
    qg = query[0].reshape(hkv, g * q, query.shape[-1])
    w = torch.matmul(qg, key[0].transpose(1, 2)) * scaling            # [Hkv, g*q, n]
    w = torch.tanh(w / softcap) * softcap
    w = w.view(hkv, g, q, -1)
    if mask is not None:
        m = mask[0, 0]
        w = w + m if m.dtype != torch.bool else w.masked_fill(~m, torch.finfo(w.dtype).min)
    p = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(p.view(hkv, g * q, -1), value[0]).view(hkv * g, q, -1)   # [H, q, d]
    return out.transpose(0, 1)[None].contiguous(), None


def _record(rec, query, key, mask, scaling) -> None:
    """Accumulate the mean attention probability per key slot (heads, queries averaged)."""
    h, hkv, q = query.shape[1], key.shape[1], query.shape[2]
    qg = query[0].float().reshape(hkv, (h // hkv) * q, query.shape[-1])
    w = (qg @ key[0].float().transpose(1, 2)) * scaling                # [Hkv, g*q, n]
    w = w.view(hkv, h // hkv, q, -1)
    if mask is not None:
        m = mask[0, 0]
        w = w + m.float() if m.dtype != torch.bool else w.masked_fill(~m, torch.finfo(w.dtype).min)
    p = torch.softmax(w, dim=-1).mean(dim=(0, 1, 2))                    # [n]
    rec["sum"] = p if rec["sum"] is None else rec["sum"] + p
    rec["n"] += 1


class recording:
    """Within this block, the calling thread's forwards also record the attention probabilities
    that ``modules`` (attention modules) pay to each key slot: ``rec["sum"] / rec["n"]``."""

    def __init__(self, modules):
        self.rec = {"modules": {id(m) for m in modules}, "sum": None, "n": 0}

    def __enter__(self):
        _local.rec = self.rec
        return self.rec

    def __exit__(self, *exc):
        _local.rec = None


def register() -> str:
    """Register :func:`attend` with transformers (once per process) and return its name."""
    global _registered
    with _lock:
        if not _registered:
            from transformers.modeling_utils import AttentionInterface
            AttentionInterface.register(IMPL, attend)
            _registered = True
    return IMPL


def recording_active() -> bool:
    """True inside :class:`recording` on this thread (its mean over queries must see no pads)."""
    return getattr(_local, "rec", None) is not None


def tail_is_causal(positions: torch.Tensor, start: int, stop: int) -> bool:
    """True when slots [0, stop) hold contiguous increasing positions (p0, p0+1, ...): a query
    block [start, stop) at their end then needs no mask beyond lower-right causality (and a
    sliding window counted in slots)."""
    if stop <= 1:
        return True
    p = positions[:stop]
    return int(p[-1]) - int(p[0]) == stop - 1 and bool((p[1:] > p[:-1]).all())


def buffer_view(data: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, n: int) -> KVCache:
    return KVCache(data[:, :, :, :n], positions[:n], token_ids[:n])
