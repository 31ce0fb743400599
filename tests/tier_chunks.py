"""Test helper: a small KV shape and its chunk keys and KV for the lm:// tier tests that talk to a
real tier server (tests/test_tier_tls.py, tests/test_tier_server_auth.py)."""
from __future__ import annotations

import torch

from kvruntime.kv import KVCache
from kvtransport.tier.store import ChunkKey, key_positions, tenant_salt

L, H, D = 2, 2, 64                      # layers, KV heads, head dim: one 256-token fp32 piece is 512 KiB


def mkkey(n: int, start: int) -> ChunkKey:
    """The key of ``n`` tokens ``start ..`` of model ``m`` (float32, rope ``5eed``), tenant ``a``, position 1."""
    return ChunkKey.build("m", "float32", "5eed", range(start, start + n), tenant_salt("a"), 1)


def mkkv(key: ChunkKey, seed: int = 0) -> KVCache:
    """Random KV of shape ``(L, 2, H, key.num_tokens, D)`` (seeded) at ``key``'s positions and tokens."""
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(L, 2, H, key.num_tokens, D, generator=g), key_positions(key),
                   torch.tensor(key.token_ids))
