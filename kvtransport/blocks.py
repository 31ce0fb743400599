"""The KV block: the unit that crosses from a prefill worker to a decode worker.

A block is a header (model, layer count, kv heads, head dim, dtype, per-slot positions and
token ids, payload size, CRC-32) and one contiguous payload: the bytes of
``KVCache.data`` ([layers, 2, kv_heads, tokens, head_dim], row-major). This module is the one
codec between blocks and tensors; transports move blocks and never look inside.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvruntime.kv import KVCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


class BlockError(ValueError):
    """A block that cannot be trusted: bad checksum, wrong size, unknown dtype, wrong model."""


@dataclass(frozen=True)
class KVBlockHeader:
    transfer_id: str
    model: str                      # registry name of the model whose KV this is
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str                      # key of DTYPES
    positions: tuple[int, ...]      # [tokens] RoPE positions
    token_ids: tuple[int, ...]      # [tokens]
    payload_bytes: int              # == layers * 2 * kv_heads * tokens * head_dim * itemsize
    checksum: int                   # CRC-32 of the payload

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def expected_bytes(self) -> int:
        if self.dtype not in DTYPES:
            raise BlockError(f"unknown dtype {self.dtype!r}")
        item = torch.empty(0, dtype=DTYPES[self.dtype]).element_size()
        return self.num_layers * 2 * self.kv_heads * self.num_tokens * self.head_dim * item


@dataclass(frozen=True)
class KVBlock:
    header: KVBlockHeader
    payload: bytes                  # contiguous KV bytes, see module docstring


def checksum(payload) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def encode_block(transfer_id: str, model: str, kv: KVCache) -> KVBlock:
    """Tensor -> block. Cost: one copy of the KV to CPU bytes plus a CRC-32 pass."""
    if kv.data.dtype not in _NAMES:
        raise BlockError(f"unsupported KV dtype {kv.data.dtype}")
    data = kv.data.detach().to("cpu").contiguous()
    payload = data.view(torch.uint8).numpy().tobytes()
    layers, _, heads, _, head_dim = data.shape
    header = KVBlockHeader(transfer_id, model, layers, heads, head_dim, _NAMES[data.dtype],
                           tuple(kv.positions.tolist()), tuple(kv.token_ids.tolist()), len(payload), checksum(payload))
    return KVBlock(header, payload)


def verify(block: KVBlock, *, model: str | None = None) -> None:
    """Raise :class:`BlockError` unless the payload matches its header (size, CRC, model)."""
    h = block.header
    if model is not None and h.model != model:
        raise BlockError(f"block is KV of model {h.model!r}, this worker serves {model!r}")
    if len(h.positions) != len(h.token_ids):
        raise BlockError("positions and token_ids differ in length")
    if h.payload_bytes != len(block.payload) or h.payload_bytes != h.expected_bytes():
        raise BlockError(f"payload is {len(block.payload)} bytes, header says {h.payload_bytes}, "
                         f"shape implies {h.expected_bytes()}")
    got = checksum(block.payload)
    if got != h.checksum:
        raise BlockError(f"checksum mismatch: header {h.checksum:#010x}, payload {got:#010x}")


def decode_block(block: KVBlock, *, model: str | None = None, device: str | torch.device = "cpu") -> KVCache:
    """Block -> tensor, after :func:`verify`. Cost: one copy of the payload."""
    verify(block, model=model)
    h = block.header
    raw = torch.frombuffer(bytearray(block.payload), dtype=torch.uint8)
    data = raw.view(DTYPES[h.dtype]).reshape(h.num_layers, 2, h.kv_heads, h.num_tokens, h.head_dim)
    return KVCache(data.to(device), torch.tensor(h.positions, dtype=torch.long, device=device),
                   torch.tensor(h.token_ids, dtype=torch.long, device=device))
