"""Store-behind computes only what the tier lacks: a prompt that extends a stored exact prefix is
compiled on from that prefix's KV (``prefill_workers.store_delta``) on the real LMCache tier with
the shipped SmolLM2, and equals a compile of the whole prompt from position 0 within the engine's
float tolerance (``test_engine``'s for exact prefix reuse: 1e-4); ``StoreBehind`` finds the base
itself (the prompt index at block boundaries and at the exact length of the tenant's previous
exact prompt, from the shared decode-held record) and counts ``stored_delta``."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvruntime.messages.keys import tenant_salt
from kvruntime.messages.plan import KVRef
from kvruntime.ops import precompile_chunk
from prefill_workers.store_delta import check_continuable

SALT = tenant_salt("acme", b"s")
TEXT = ("User: the harbour office in Tromso opens at 07:30 on weekdays; when do ferries to Skjervoy leave?\n"
        "Assistant: at 08:15 and 16:40, tickets cost 210 kroner for adults and half price for children.\n")


def test_only_an_exact_shorter_prefix_can_be_continued():
    ids = tuple(range(100))
    check_continuable(KVRef(ids, 0, SALT), KVRef(ids[:40], 0, SALT))
    for base in (KVRef(ids, 0, SALT), KVRef(ids[:40], 0, "x" * 32), KVRef((7,) + ids[1:40], 0, SALT),
                 KVRef(ids[:40], 0, SALT, approx="ab" * 16), KVRef(ids[:40], 1, SALT), KVRef((), 0, SALT)):
        with pytest.raises(ValueError):
            check_continuable(KVRef(ids, 0, SALT), base)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_a_store_continues_from_the_held_prefix_and_equals_a_compile_from_zero(smol):
    from kvruntime.config import TierConfig
    from kvtransport.tier.lmcache_store import LMCacheStore
    from prefill_workers.tier_reads import PrefillTier

    store = LMCacheStore.for_engine(smol, TierConfig(cpu_bytes=200 << 20))
    try:
        tier = PrefillTier(store, smol)
        ids = tuple(smol.encode(TEXT * 16))
        turn0, turn1 = KVRef(ids[:301], 0, SALT), KVRef(ids[:560], 0, SALT)     # a conversation, one turn on
        assert tier.precompile(turn0).start == 0
        info = tier.precompile(turn1, base=turn0)
        assert (info.cached, info.start) == (False, 301)
        got, want = tier.get(turn1), precompile_chunk(smol, list(turn1.token_ids), [])
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.positions, want.positions)
        assert torch.allclose(got.data, want.data, atol=1e-4, rtol=0), float((got.data - want.data).abs().max())
        assert torch.equal(got.data[:, :, :, :301], tier.get(turn0).data)      # the held slots as stored
        other = tuple(smol.encode(TEXT.upper() * 4))[:300]
        gone = KVRef(other, 0, SALT)                                            # its base never stored: from 0
        info = tier.precompile(gone, base=KVRef(other[:200], 0, SALT))
        assert info.start == 0 and torch.equal(tier.get(gone).data, precompile_chunk(smol, list(gone.token_ids), []).data)
        assert tier.precompile(turn1, base=turn0).cached                        # idempotent by content
    finally:
        store.close()


class _TierBackends:
    """A prefill worker's tier in process (the real ``PrefillTier`` over LMCache)."""

    def __init__(self, tier):
        self.tier, self.calls = tier, []

    async def contains(self, refs, index=0):
        return self.tier.contains(refs)

    async def precompile(self, ref, index=0, base=None):
        self.calls.append((len(ref.token_ids), None if base is None else len(base.token_ids)))
        return self.tier.precompile(ref, base)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_store_behind_compiles_a_growing_conversation_past_the_previous_turn(smol, tmp_path):
    from cluster.control.decode_held import DecodeHeld
    from cluster.control.metrics import Metrics
    from cluster.control.prompt_index import PromptIndex
    from cluster.control.state import open_state
    from cluster.control.store_behind import StoreBehind
    from cluster.control.tier_lookup import TierLookup
    from kvruntime.config import TierConfig
    from kvtransport.tier.lmcache_store import LMCacheStore
    from prefill_workers.tier_reads import PrefillTier
    from tests.conftest import metric

    store = LMCacheStore.for_engine(smol, TierConfig(cpu_bytes=200 << 20))
    state = open_state(f"sqlite:///{tmp_path}/state.db")
    try:
        b, m = _TierBackends(PrefillTier(store, smol)), Metrics()
        index = PromptIndex(state, m, TierLookup(b, m))
        held = DecodeHeld(state, metrics=m)
        sb = StoreBehind(b, m, index, held=held)
        ids = tuple(smol.encode(TEXT * 16))

        async def turn(n):                 # what the router does for a plain prompt vLLM computed exactly
            prompt = ids[:n]
            held.note("acme", prompt)
            assert sb.schedule("acme", KVRef(prompt[:-1], 0, SALT), 0, 0) == "scheduled"
            await sb.drain()
        for n in (300, 540, 600):
            asyncio.run(turn(n))
        # turn 0 from 0; turn 1 after turn 0's exact 299 tokens (no block boundary); turn 2 after turn 1's 539
        assert b.calls == [(299, None), (539, 299), (599, 539)]
        text = m.render().decode()
        assert metric(text, "kvnotes_prompt_stores_total", outcome="stored_delta") == 2
        assert metric(text, "kvnotes_prompt_stores_total", outcome="stored") == 1
        assert index.indexed("acme", ids[:599])                                  # the whole prompt is found
        got, want = b.tier.get(KVRef(ids[:599], 0, SALT)), precompile_chunk(smol, list(ids[:599]), [])
        assert torch.allclose(got.data, want.data, atol=1e-4, rtol=0)
    finally:
        state.close()
        store.close()
