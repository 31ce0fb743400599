"""Full recompute: the exact oracle every other operation is measured against."""
from __future__ import annotations

import torch

from kvruntime.engine import PrefillOutput


def recompute(engine, token_ids: list[int], *, logits: bool = True) -> PrefillOutput:
    """Prefill ``token_ids`` at positions 0..n-1 from nothing. Cost: O(n^2) attention x L."""
    return engine.prefill(token_ids, torch.arange(len(token_ids)), logits=logits)
