"""Reference decoding in O(n) per token: the context's KV is copied once into a preallocated
buffer and each step writes only its own token's KV. Tokens must equal the previous
implementation (a fresh HF cache per step plus a whole-cache concatenation) on both real models."""
import pytest
import torch

from bench.decode_step import _old as old_loop
from kvruntime.decode_cache import DecodeSession
from kvruntime.ops import recompute

pytestmark = pytest.mark.slow

TEXT = ("Ledger note: the Harbour Street branch opened in 2011, employs 42 people and its manager is Ines Okafor. "
        "The Quay Road branch opened in 2016 and employs 17 people. ") * 6 + "Who manages the Harbour Street branch?"


def test_generate_equals_the_concatenating_loop(engine, one_torch_thread):
    ids = engine.encode(TEXT)
    ctx = recompute(engine, ids)
    new = engine.greedy(ctx.kv, ctx.logits, 24)
    assert new == old_loop(engine, ctx.kv, ctx.logits, 24)       # the implementation this replaced


def test_session_writes_in_place_and_matches_recompute(smol, one_torch_thread):
    ids = smol.encode(TEXT)
    head, tail = ids[:-6], ids[-6:]
    ctx = recompute(smol, head, logits=False)
    s = DecodeSession(smol, ctx.kv, extra=len(tail))
    buf = s.data.data_ptr()
    for i, t in enumerate(tail):                 # one token at a time, as decoding does
        logits = s.step([t], [len(head) + i])
    assert s.data.data_ptr() == buf and s.length == len(ids) == s.capacity
    full = recompute(smol, ids)
    assert torch.equal(s.kv.token_ids, full.kv.token_ids) and torch.equal(s.kv.positions, full.kv.positions)
    assert torch.allclose(s.kv.data, full.kv.data, atol=2e-4, rtol=1e-3)
    assert int(torch.argmax(logits)) == int(torch.argmax(full.logits))


def test_session_refuses_overflow_and_out_of_order_positions(smol):
    ctx = recompute(smol, smol.encode("A short context."), logits=False)
    s = DecodeSession(smol, ctx.kv, extra=1)
    with pytest.raises(ValueError, match="positions must continue"):
        s.step([42], [0])
    s.step([42], [s.next_position])
    with pytest.raises(ValueError, match="buffer full"):
        s.step([43], [s.next_position])
    assert s.length == ctx.kv.num_tokens + 1
