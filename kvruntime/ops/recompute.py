"""Full recompute: the exact oracle every other operation is measured against."""
from __future__ import annotations

import torch

from kvruntime.engine import PrefillOutput
from kvruntime.kv import KVCache

DEFAULT_PREFILL_CHUNK = 2048  # tokens per forward; bounds the [heads, q, k] attention matrix


def recompute(engine, token_ids: list[int], *, logits: bool = True,
              chunk_size: int = DEFAULT_PREFILL_CHUNK) -> PrefillOutput:
    """Prefill ``token_ids`` at positions 0..n-1 from nothing, ``chunk_size`` tokens per forward
    (chunked prefill: same result, attention memory O(chunk * n) instead of O(n^2)).
    Cost: O(n^2) attention x L."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n = len(token_ids)
    kv, out = None, None
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        out = engine.prefill(token_ids[s:e], torch.arange(s, e), kv, logits=logits and e == n)
        kv = out.kv if kv is None else KVCache.cat([kv, out.kv])
    if out is None:
        raise ValueError("cannot recompute an empty token sequence")
    return PrefillOutput(out.logits, kv)
