"""Decoding without copying the context: a preallocated KV buffer that the model writes into.

:meth:`ReferenceEngine.prefill` builds a fresh HF cache from a :class:`KVCache` on every call and
HF's ``DynamicLayer`` concatenates past and new keys in every layer; a decode loop that calls it
once per token and then concatenates the result onto its cache copies the whole context twice
per token (O(n^2) bytes moved for n tokens). A :class:`DecodeSession` allocates the context plus
the tokens still to come once; each step's new keys and values are written into that buffer in
place by :class:`_BufferLayer` and attention reads a view of the filled part, so a step costs its
attention over the context (O(n)) and nothing else grows with n.

Slots stay in position order (decoding appends positions after the context), as sliding-window
masks and vLLM assume.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvruntime.kv import KVCache


class _BufferLayer(DynamicLayer):
    """One layer's keys/values in a preallocated ``[1, kv_heads, capacity, head_dim]`` buffer;
    ``update`` writes the new tokens after the filled part and returns views (no copy)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buf_k, self.buf_v, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.buf_k.shape[-2]:
            raise ValueError(f"decode buffer full: {end} tokens > capacity {self.buf_k.shape[-2]}")
        self.buf_k[:, :, self.length:end].copy_(key_states)
        self.buf_v[:, :, self.length:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self.buf_k[:, :, :end], self.buf_v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class _BufferCache(Cache):
    def __init__(self, layers: list[_BufferLayer]):
        super().__init__(layers=layers)


class DecodeSession:
    """A context's KV plus room for ``extra`` more tokens; :meth:`step` runs tokens through the
    model against everything so far and keeps their KV in place.

    ``data`` is ``[layers, 2, kv_heads, capacity, head_dim]`` in the engine's dtype; ``positions``
    and ``token_ids`` are ``[capacity]`` int64; the first :attr:`length` slots are filled.
    """

    def __init__(self, engine, kv: KVCache, extra: int):
        if extra < 0:
            raise ValueError("extra must be >= 0")
        if kv.num_tokens and not kv.is_position_ordered():
            kv = kv.sorted_by_position()       # attention is by position (explicit masks): same result
        self.engine = engine
        n, cap = kv.num_tokens, kv.num_tokens + extra
        self.data = torch.empty(engine.num_layers, 2, engine.kv_heads, cap, engine.head_dim,
                                dtype=engine.dtype, device=engine.device)
        self.positions = torch.empty(cap, dtype=torch.long, device=engine.device)
        self.token_ids = torch.empty(cap, dtype=torch.long, device=engine.device)
        if n:
            self.data[:, :, :, :n] = kv.data.to(engine.device, engine.dtype)
            self.positions[:n] = kv.positions.to(engine.device)
            self.token_ids[:n] = kv.token_ids.to(engine.device)
        self.length = n

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def kv(self) -> KVCache:
        """The filled slots (views of the buffer, no copy)."""
        return KVCache(self.data[:, :, :, :self.length], self.positions[:self.length], self.token_ids[:self.length])

    @property
    def next_position(self) -> int:
        return int(self.positions[self.length - 1]) + 1 if self.length else 0

    @torch.inference_mode()
    def step(self, token_ids, positions) -> torch.Tensor:
        """Run ``token_ids`` at ``positions`` (both [q]) against the filled slots; their KV is
        appended in place. Returns the last token's next-token logits ([vocab], fp32)."""
        e = self.engine
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=e.device)
        pos = torch.as_tensor(list(positions), dtype=torch.long, device=e.device)
        q, n = ids.numel(), self.length
        if q == 0 or pos.shape != ids.shape:
            raise ValueError("need equal, non-zero numbers of token ids and positions")
        if n + q > self.capacity:
            raise ValueError(f"decode buffer full: {n + q} tokens > capacity {self.capacity}")
        if n and int(pos.min()) <= int(self.positions[n - 1]):
            raise ValueError("positions must continue after the context (slots stay in position order)")
        self.positions[n:n + q] = pos
        self.token_ids[n:n + q] = ids
        cache = _BufferCache([_BufferLayer(self.data[i, 0][None], self.data[i, 1][None], n)
                              for i in range(e.num_layers)])
        mask = e._mask(pos, self.positions[:n + q])
        with e._lock:
            out = e.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.length = n + q
        return out.logits[0, -1].float()
