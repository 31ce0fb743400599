"""Full recompute: the exact oracle every other operation is measured against."""
from __future__ import annotations

import torch

from kvruntime.engine import PrefillOutput

DEFAULT_PREFILL_CHUNK = 2048  # tokens per forward; bounds the [heads, q, k] attention matrix


def recompute(engine, token_ids: list[int], *, logits: bool = True,
              chunk_size: int = DEFAULT_PREFILL_CHUNK) -> PrefillOutput:
    """Prefill ``token_ids`` at positions 0..n-1 from nothing, ``chunk_size`` tokens per forward
    (chunked prefill: same result, attention memory O(chunk * n) instead of O(n^2)), each chunk
    writing its K/V into one buffer of n slots and attending to the slots before it in place.
    Cost: O(n^2) attention x L."""
    from kvruntime.ops.build import Builder
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n = len(token_ids)
    if n == 0:
        raise ValueError("cannot recompute an empty token sequence")
    b, last = Builder(engine, n), None
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        last = b.compute(token_ids[s:e], s, logits=logits and e == n)
    return PrefillOutput(last, b.kv)
