"""Decoding without copying the context: a preallocated KV buffer that the model writes into.

:meth:`ReferenceEngine.prefill` given a plain :class:`KVCache` copies it into a new buffer on every
call; a decode loop that calls it once per token and then concatenates the result onto its cache
copies the whole context twice per token (O(n^2) bytes moved for n tokens). A :class:`DecodeSession` allocates the context plus
the tokens still to come once; each step's new keys and values are written into that buffer in
place (:meth:`ReferenceEngine.write`: at a bucket's shape under ``few_token_shapes: bucketed``)
and attention reads a view of the filled part, so a step costs its attention over the context
(O(n)) and nothing else grows with n.

A session can also *adopt* a buffer the context already sits in (``buffer=``): the decode worker
receives a prefix block straight into a ``[layers, 2, kv_heads, prefix + room, head_dim]`` buffer
(the grant's room, ``kvtransport.transfer.blocks.SlotLayout``), so the received prefix is never
copied; :attr:`DecodeSession.copied_bytes` counts the KV bytes a session did copy (0 then).

Slots stay in position order (decoding appends positions after the context), as sliding-window
masks and vLLM assume.
"""
from __future__ import annotations

import torch

from kvruntime.kv import KVCache


class DecodeSession:
    """A context's KV plus room for ``extra`` more tokens; :meth:`step` runs tokens through the
    model against everything so far and keeps their KV in place.

    ``data`` is ``[layers, 2, kv_heads, capacity, head_dim]`` in the engine's dtype; ``positions``
    and ``token_ids`` are ``[capacity]`` int64; the first :attr:`length` slots are filled.
    """

    def __init__(self, engine, kv: KVCache, extra: int, *, buffer: torch.Tensor | None = None):
        if extra < 0:
            raise ValueError("extra must be >= 0")
        if kv.num_tokens and not kv.is_position_ordered():
            kv = kv.sorted_by_position()       # attention is by position (explicit masks): same result
            buffer = None                      # the buffer's slots are not in position order
        self.engine = engine
        n, cap = kv.num_tokens, kv.num_tokens + extra
        self.copied_bytes = 0                  # KV bytes copied into the session's buffer
        if buffer is not None and _holds(buffer, kv, cap, engine):
            self.data = buffer                 # adopted: the context is where it was received
        else:
            self.data = torch.empty(engine.num_layers, 2, engine.kv_heads, cap, engine.head_dim,
                                    dtype=engine.dtype, device=engine.device)
            if n:
                self.data[:, :, :, :n] = kv.data.to(engine.device, engine.dtype)
                self.copied_bytes = kv.nbytes
        self.positions = torch.empty(self.capacity, dtype=torch.long, device=engine.device)
        self.token_ids = torch.empty(self.capacity, dtype=torch.long, device=engine.device)
        if n:
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
    def step(self, token_ids, positions, *, logits: bool = True) -> torch.Tensor | None:
        """Run ``token_ids`` at ``positions`` (both [q]) against the filled slots; their KV is
        written in place (:meth:`ReferenceEngine.write`). Returns the last token's next-token
        logits ([vocab], fp32; None when not ``logits``)."""
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
        if q > 1 and bool((pos[1:] <= pos[:-1]).any()):
            raise ValueError("positions must increase (slots stay in position order)")
        self.positions[n:n + q] = pos
        self.token_ids[n:n + q] = ids
        out = e.write(self.data, self.positions, self.token_ids, slice(n, n + q), n + q, logits=logits)
        self.length = n + q
        return out


def _holds(buffer: torch.Tensor, kv: KVCache, cap: int, engine) -> bool:
    """Whether ``buffer`` ([layers, 2, kv_heads, >= cap, head_dim], the engine's dtype and device)
    holds ``kv`` as its first slots (the same memory: ``kv.data`` is a view of it)."""
    want = (engine.num_layers, 2, engine.kv_heads)
    return (tuple(buffer.shape[:3]) == want and buffer.shape[3] >= cap and buffer.shape[4] == engine.head_dim
            and buffer.dtype == engine.dtype and buffer.device == engine.device
            and kv.data.data_ptr() == buffer.data_ptr() and kv.data.stride() == buffer.stride())
