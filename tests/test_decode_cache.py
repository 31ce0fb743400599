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


def test_session_steps_run_at_bucket_shapes_under_bucketed(smol, one_torch_thread, monkeypatch):
    """DecodeSession.step is ReferenceEngine.write on its buffer: under few_token_shapes
    ``bucketed`` a 3-token suffix runs as bucket 4 and a decode step as bucket 1, with the eager
    session's tokens and (within float rounding) its logits and KV."""
    from tests.test_buckets import shapes
    ids = smol.encode(TEXT)
    head, tail = ids[:-3], ids[-3:]
    ctx = recompute(smol, head, logits=False)
    buckets = []
    real = type(smol).write_padded
    monkeypatch.setattr(type(smol), "write_padded",
                        lambda self, *a, **kw: buckets.append(a[6]) or real(self, *a, **kw))
    runs = {}
    for kind in ("eager", "bucketed"):
        with shapes(smol, kind):
            s = DecodeSession(smol, ctx.kv, extra=len(tail) + 4)
            logits = [s.step(tail, range(len(head), len(ids)))]
            for _ in range(4):
                logits.append(s.step([int(torch.argmax(logits[-1]))], [s.next_position]))
            runs[kind] = (s.kv.data.clone(), torch.stack(logits), s.kv.token_ids.clone())
    assert buckets == [4, 1, 1, 1, 1]                                    # only the bucketed run padded
    (d0, l0, t0), (d1, l1, t1) = runs["eager"], runs["bucketed"]
    assert torch.equal(t0, t1)                                           # the same greedy tokens
    assert torch.allclose(l0, l1, atol=1e-4, rtol=1e-4) and torch.allclose(d0, d1, atol=1e-5, rtol=1e-4)


def test_a_session_adopts_a_buffer_that_holds_its_context_and_copies_otherwise(smol, one_torch_thread):
    ids = smol.encode(TEXT)
    ctx = recompute(smol, ids[:-2], logits=False)
    n = ctx.kv.num_tokens
    buf = torch.empty(smol.num_layers, 2, smol.kv_heads, n + 5, smol.head_dim, dtype=smol.dtype)
    buf[:, :, :, :n] = ctx.kv.data
    view = type(ctx.kv)(buf[:, :, :, :n], ctx.kv.positions, ctx.kv.token_ids)
    adopted = DecodeSession(smol, view, extra=5, buffer=buf)
    copied = DecodeSession(smol, ctx.kv, extra=5)
    assert adopted.data is buf and adopted.copied_bytes == 0 and copied.copied_bytes == ctx.kv.nbytes
    a = adopted.step(ids[-2:], [n, n + 1])
    b = copied.step(ids[-2:], [n, n + 1])
    assert torch.equal(a, b) and torch.equal(adopted.kv.data, copied.kv.data)     # the same math, bit-equal
    small = DecodeSession(smol, view, extra=6, buffer=buf)                       # no room for 6: a copy
    other = DecodeSession(smol, ctx.kv, extra=5, buffer=buf)                     # not a view of buf: a copy
    assert small.data is not buf and other.data is not buf and other.copied_bytes == ctx.kv.nbytes
