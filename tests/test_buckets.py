"""Few-token forwards at bucket shapes (kvruntime.buckets): on the 7 tiny families and both shipped
models, a bucketed forward gives the logits and KV of the eager one -- a question after the
context, a 45-token question (bucket 64), scattered slots (seam repair) -- writes no slot but the
real tokens' (pads never reach the buffer) and, reading the whole buffer through the key length
(what a captured graph reads), the same values again.

Tolerance: float32, max |bucketed - eager| <= 1e-5 x max(1, max |eager|) (the same arithmetic on
matmuls of another row count and an additive mask in place of lower-right causality: observed
<= 5e-7 on the tiny families); bfloat16, <= 3e-2 x the same scale (a few roundings of its 8-bit
mantissa, 0.8% each; observed 0 on the tiny families on this CPU)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kvruntime.buckets import BUCKETS, bucket_for, pad_step
from kvruntime.config.choices import ForwardShapes
from kvruntime.config.workers import WorkersConfig
from kvruntime.ops import recompute
from tests.conftest import get_engine, tiny_engine

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
SENTINEL = 7.0          # spare capacity: must still hold this after every forward
CTX, ROOM = 40, 64


def test_buckets_are_powers_of_two_up_to_64():
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(q) for q in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket_for(65) is None
    with pytest.raises(ValueError, match=">= 1 new token"):
        bucket_for(0)


def test_pads_repeat_the_last_real_token_and_its_slot():
    idx, ids, pos = torch.tensor([9, 4, 6]), torch.tensor([11, 12, 13]), torch.tensor([30, 31, 40])
    s = pad_step(idx, ids, pos, keys=50, bucket=8)
    assert s.bucket == 8 and s.real == 3 and int(s.key_len) == 50 and s.last.tolist() == [2]
    assert s.slots.tolist() == [9, 4, 6, 6, 6, 6, 6, 6] and s.src.tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    assert s.ids.tolist() == [11, 12, 13] + [13] * 5 and s.pos.tolist() == [30, 31, 40] + [40] * 5
    with pytest.raises(ValueError, match="do not fit bucket 2"):
        pad_step(idx, ids, pos, keys=50, bucket=2)


def test_the_setting_is_typed_and_checked():
    assert WorkersConfig().few_token_shapes is ForwardShapes.EAGER
    assert WorkersConfig(few_token_shapes="bucketed").few_token_shapes is ForwardShapes.BUCKETED
    with pytest.raises(ValueError, match="few_token_shapes must be one of eager, bucketed"):
        WorkersConfig(few_token_shapes="graphs")
    from kvruntime.config import ClusterConfig
    assert ClusterConfig.from_dict({"few_token_shapes": "bucketed"}).workers.few_token_shapes is ForwardShapes.BUCKETED


@contextlib.contextmanager
def shapes(e, kind):
    prev, e.shapes = e.shapes, ForwardShapes.of(kind)
    try:
        yield
    finally:
        e.shapes = prev


def _ids(e, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(500, e.model.config.vocab_size), (n,), generator=g)


def _buffer(e, ctx_ids):
    """The context's KV in a buffer with ROOM spare slots holding SENTINEL (positions 0..)."""
    kv = recompute(e, ctx_ids.tolist()).kv
    cap = CTX + ROOM
    data = torch.full((e.num_layers, 2, e.kv_heads, cap, e.head_dim), SENTINEL, dtype=e.dtype)
    data[:, :, :, :CTX] = kv.data
    return data, torch.arange(cap), torch.cat([ctx_ids, _ids(e, ROOM, 9)])


def _cases(e):
    """(what, slots, keys): questions after the context and seam-like scattered slots inside it."""
    return [(f"question q={q}", slice(CTX, CTX + q), CTX + q) for q in (1, 3, 5, 45)] + \
           [("scattered slots", torch.tensor([3, 17, 25, 39]), CTX)]


def _run(e, kind, data, pos, ids, slots, keys):
    d = data.clone()
    with shapes(e, kind):
        logits = e.write(d, pos, ids, slots, keys, logits=True)
    return logits, d


def _close(got, want, tol, what):
    scale = max(1.0, float(want.float().abs().max()))
    err = float((got.float() - want.float()).abs().max()) / scale
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _check(e, tol):
    ctx = _ids(e, CTX, 1)
    data, pos, ids = _buffer(e, ctx)
    for what, slots, keys in _cases(e):
        want_l, want_d = _run(e, "eager", data, pos, ids, slots, keys)
        got_l, got_d = _run(e, "bucketed", data, pos, ids, slots, keys)
        _close(got_l, want_l, tol, f"{what} logits")
        _close(got_d, want_d, tol, f"{what} kv")
        written = torch.zeros(data.shape[3], dtype=torch.bool)
        written[slots] = True
        assert torch.equal(got_d[:, :, :, ~written], data[:, :, :, ~written]), f"{what}: a pad reached the buffer"
        assert bool((got_d[:, :, :, keys:] == SENTINEL).all()), what


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bucketed_equals_eager_on_each_family(tiny_checkpoints, family):
    e = tiny_engine(tiny_checkpoints, family)
    _check(e, TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_bucketed_equals_eager_in_bfloat16(tiny_checkpoints, family):
    e = tiny_engine(tiny_checkpoints, family, dtype="bfloat16")
    _check(e, TOL[torch.bfloat16])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_bucketed_equals_eager_on_the_shipped_models(model):
    _check(get_engine(model), TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_reading_the_whole_buffer_through_the_length_gives_the_same(tiny_checkpoints, family):
    """span = capacity (a graph's fixed read; the slots past the length zeros, finite): the same
    logits and KV as the eager forward, for a question of 5 (bucket 8)."""
    e = tiny_engine(tiny_checkpoints, family)
    data, pos, ids = _buffer(e, _ids(e, CTX, 2))
    data[:, :, :, CTX:] = 0
    want_l, want_d = _run(e, "eager", data, pos, ids, slice(CTX, CTX + 5), CTX + 5)
    d, idx = data.clone(), torch.arange(CTX, CTX + 5)
    got_l = e.write_padded(d, pos, idx, ids[idx], pos[idx], CTX + 5, 8, span=data.shape[3], logits=True)
    _close(got_l, want_l, TOL[torch.float32], "logits")
    _close(d, want_d, TOL[torch.float32], "kv")
    with pytest.raises(ValueError, match="span must hold"):
        e.write_padded(d, pos, idx, ids[idx], pos[idx], CTX + 5, 8, span=CTX)
