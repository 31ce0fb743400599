"""A prompt's KV compiled on from a stored exact prefix of it (store-behind's delta,
:mod:`cluster.control.store_behind`): the tier holds the first ``len(base)`` tokens' KV (an
earlier prompt of the conversation, stored from position 0), so only the rest goes through a
forward, attending to that KV, and the two are joined. Exact: the prefix's slots are the ones a
forward from position 0 computes (they depend on nothing after them) and each later token's
forward reads the same keys and values, so the result equals compiling the whole prompt from
position 0 within the engine's float tolerance (``tests/test_store_delta.py`` checks it on the
reference engine; the tier keeps the engine's KV dtype, ``kvtransport.tier.store.key_for``)."""
from __future__ import annotations

import torch

from kvruntime.kv import KVCache
from kvruntime.messages.plan import KVRef


def check_continuable(ref: KVRef, base: KVRef) -> None:
    """ValueError unless ``base`` is an exact stored prompt prefix (position 0, the same tenant's
    salt) strictly shorter than ``ref``, which starts with its tokens."""
    for r in (ref, base):
        if not r.exact or r.position != 0 or r.prefix is not None:
            raise ValueError("a store continues only an exact prompt prefix (position 0, no compile prefix)")
    n = len(base.token_ids)
    if base.tenant_salt != ref.tenant_salt or not 0 < n < len(ref.token_ids) or ref.token_ids[:n] != base.token_ids:
        raise ValueError(f"the base ({n} tokens) is not a shorter prefix of the {len(ref.token_ids)}-token prompt "
                         "under the same salt")


def continued(engine, ref: KVRef, base: KVRef, base_kv: KVCache) -> KVCache:
    """``ref``'s KV: ``base_kv`` (the tier's KV of ``base``) and the rest computed after it.
    Cost: one prefill of the rest, O(rest * len(ref)) attention, instead of O(len(ref)^2)."""
    check_continuable(ref, base)
    n = len(base.token_ids)
    if base_kv.num_tokens != n:
        raise ValueError(f"the base's KV holds {base_kv.num_tokens} slots, not its {n} tokens")
    base_kv = base_kv.to(device=engine.device, dtype=engine.dtype)
    rest = engine.prefill(list(ref.token_ids[n:]), torch.arange(n, len(ref.token_ids)), base_kv).kv
    return KVCache.cat([base_kv, rest])
