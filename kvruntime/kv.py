"""The one KV layout of kvnotes. Every other module converts to and from this, nowhere else.

A :class:`KVCache` is a run of cache slots for one sequence: keys *after* RoPE at the slot's
position (HF rotate_half convention), values, the slot's RoPE position and its token id. Slots
are kept in position order whenever a cache is handed to decoding (sliding-window masks and
vLLM both assume slot order == position order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCache:
    data: torch.Tensor       # [layers, 2, kv_heads, tokens, head_dim]; [:, 0] keys (post-RoPE), [:, 1] values
    positions: torch.Tensor  # [tokens] int64: the RoPE position each slot's key was rotated to
    token_ids: torch.Tensor  # [tokens] int64: the token each slot was computed from

    def __post_init__(self) -> None:
        if self.data.dim() != 5 or self.data.shape[1] != 2:
            raise ValueError(f"KV data must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(self.data.shape)}")
        n = self.data.shape[3]
        if self.positions.shape != (n,) or self.token_ids.shape != (n,):
            raise ValueError(f"positions {tuple(self.positions.shape)} and token_ids "
                             f"{tuple(self.token_ids.shape)} must both be ({n},)")

    @property
    def num_tokens(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def keys(self) -> torch.Tensor:    # [layers, kv_heads, tokens, head_dim]
        return self.data[:, 0]

    @property
    def values(self) -> torch.Tensor:  # [layers, kv_heads, tokens, head_dim]
        return self.data[:, 1]

    @staticmethod
    def empty(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "KVCache":
        return KVCache(torch.empty(layers, 2, kv_heads, 0, head_dim, dtype=dtype, device=device),
                       torch.empty(0, dtype=torch.long, device=device),
                       torch.empty(0, dtype=torch.long, device=device))

    def slice(self, start: int, stop: int | None = None) -> "KVCache":
        """Slots ``[start, stop)`` (views, no copy)."""
        return KVCache(self.data[:, :, :, start:stop], self.positions[start:stop], self.token_ids[start:stop])

    def select(self, index: torch.Tensor) -> "KVCache":
        """Slots at ``index`` ([n] int64), in that order (copies)."""
        return KVCache(self.data.index_select(3, index), self.positions[index], self.token_ids[index])

    def with_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> "KVCache":
        """Same values and tokens, new keys ([layers, kv_heads, tokens, head_dim]) at ``positions``."""
        return KVCache(torch.stack([keys, self.values], dim=1), positions, self.token_ids)

    def sorted_by_position(self) -> "KVCache":
        order = torch.argsort(self.positions, stable=True)
        if bool((order == torch.arange(len(order), device=order.device)).all()):
            return self
        return self.select(order)

    def is_position_ordered(self) -> bool:
        return self.num_tokens < 2 or bool((self.positions[1:] > self.positions[:-1]).all())

    @staticmethod
    def cat(parts: list["KVCache"], alloc=None) -> "KVCache":
        """Concatenate along tokens. Cost: one copy of all slots. ``alloc(shape, dtype) -> Tensor
        | None``: where the result is written (e.g. a transport's registered memory, so that it
        is sent without another copy); None from it (or parts of mixed dtype/device): a new tensor."""
        parts = [p for p in parts if p.num_tokens] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        datas = [p.data for p in parts]
        out = None
        if alloc is not None and all(d.dtype == datas[0].dtype and d.device == datas[0].device for d in datas):
            shape = (*datas[0].shape[:3], sum(d.shape[3] for d in datas), datas[0].shape[4])
            out = alloc(shape, datas[0].dtype) if datas[0].device.type == "cpu" else None
        return KVCache(torch.cat(datas, dim=3) if out is None else torch.cat(datas, dim=3, out=out),
                       torch.cat([p.positions for p in parts]),
                       torch.cat([p.token_ids for p in parts]))

    def to_legacy(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(keys, values)`` as ``[1, kv_heads, tokens, head_dim]`` views (HF layout)."""
        return [(self.data[i, 0].unsqueeze(0), self.data[i, 1].unsqueeze(0)) for i in range(self.data.shape[0])]

    def to(self, device=None, dtype=None) -> "KVCache":
        return KVCache(self.data.to(device=device, dtype=dtype), self.positions.to(device), self.token_ids.to(device))


class KVBuffer:
    """A KV whose final size is known, written left to right into ``data`` ([layers, 2, kv_heads,
    capacity, head_dim], allocated once by the caller, e.g. in a transport's registered memory)
    instead of being concatenated step by step (which copies everything before at every step:
    quadratic in the number of steps). :meth:`view` is the KV written so far: views of ``data``,
    so a forward attending to it reads the buffer in place and an in-place repair writes into it."""

    def __init__(self, data: torch.Tensor):
        if data.dim() != 5 or data.shape[1] != 2:
            raise ValueError(f"KV buffer must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(data.shape)}")
        self.data = data
        self.positions = torch.empty(data.shape[3], dtype=torch.long, device=data.device)
        self.token_ids = torch.empty(data.shape[3], dtype=torch.long, device=data.device)
        self.length = 0

    @classmethod
    def holding(cls, data: torch.Tensor, kv: KVCache) -> "KVBuffer":
        """A buffer over ``data`` whose first slots already hold ``kv`` (``kv.data`` is a view of
        them: the same memory and strides, e.g. a block received with room); nothing is copied
        but the slots' positions and token ids. ValueError when ``kv`` is not ``data``'s first slots."""
        buf = cls(data)
        n = kv.num_tokens
        if n > buf.capacity or kv.data.data_ptr() != data.data_ptr() or kv.data.stride() != data.stride() \
                or kv.data.shape[:3] != data.shape[:3] or kv.data.shape[4] != data.shape[4]:
            raise ValueError("the KV is not the first slots of this buffer (another tensor, or other strides)")
        buf.positions[:n], buf.token_ids[:n] = kv.positions, kv.token_ids
        buf.length = n
        return buf

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def view(self) -> KVCache:
        n = self.length
        return KVCache(self.data[:, :, :, :n], self.positions[:n], self.token_ids[:n])

    def slot(self, n: int) -> torch.Tensor:
        """The next ``n`` slots' data ([layers, 2, kv_heads, n, head_dim] view) to write into; they
        count as written once :meth:`commit` is called."""
        if self.length + n > self.capacity:
            raise ValueError(f"{n} more slots overflow the KV buffer ({self.length} of {self.capacity} written)")
        return self.data[:, :, :, self.length:self.length + n]

    def commit(self, positions: torch.Tensor, token_ids: torch.Tensor) -> KVCache:
        """The next ``len(positions)`` slots (their data written through :meth:`slot`) hold these
        positions and tokens; returns :meth:`view`."""
        n = positions.shape[0]
        self.slot(n)
        self.positions[self.length:self.length + n] = positions
        self.token_ids[self.length:self.length + n] = token_ids
        self.length += n
        return self.view()

    def append(self, part: KVCache) -> KVCache:
        """Copy ``part`` (any dtype / device: cast while copied) after the slots written so far."""
        self.slot(part.num_tokens).copy_(part.data)
        return self.commit(part.positions, part.token_ids)
