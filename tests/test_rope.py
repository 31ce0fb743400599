"""RoPE re-rotation: pure-function properties, then against keys the real models compute."""
import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.ops import compose, ChunkSegment, TextSegment, reposition
from kvruntime.rope import RepositionDisabled, RopeTable, rotate_keys, self_test


def _table(layers=3, head_dim=16, base=10000.0):
    half = head_dim // 2
    inv = 1.0 / base ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    return RopeTable(inv.repeat(layers, 1), head_dim)


def test_rotation_composes_and_inverts():
    t = _table()
    k = torch.randn(3, 2, 5, 16)
    once = t.rotate(t.rotate(k, 40), 60)
    assert torch.allclose(once, t.rotate(k, 100), atol=1e-5)
    assert torch.allclose(t.rotate(t.rotate(k, 1234), -1234), k, atol=1e-5)
    assert torch.allclose(t.rotate(k, 0), k)


def test_rotation_preserves_norm_and_partial_rotary_leaves_tail():
    half = 4  # rotary_dim 8 of head_dim 16
    inv = (1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)).repeat(2, 1)
    k = torch.randn(2, 1, 7, 16)
    out = rotate_keys(k, torch.arange(7) * 13, inv)
    assert torch.allclose(out[..., 8:], k[..., 8:])          # dims past rotary_dim untouched
    assert torch.allclose(out.norm(dim=-1), k.norm(dim=-1), atol=1e-5)
    assert not torch.allclose(out[..., :8], k[..., :8])


def test_rotation_rejects_bad_shapes():
    t = _table()
    with pytest.raises(ValueError):
        t.rotate(torch.randn(2, 1, 4, 16), 3)            # wrong layer count
    with pytest.raises(ValueError):
        t.rotate(torch.randn(3, 1, 4, 16), torch.tensor([1, 2]))  # delta length mismatch


@pytest.mark.slow
@pytest.mark.parametrize("p,q", [(1, 900), (2500, 40)])
def test_reposition_matches_keys_computed_at_target(engine, p, q):
    """Keys of a chunk computed at p, re-rotated to q == keys the model computes at q (fp32)."""
    ids = engine.encode("Invoice 4471 was issued to Marta Keller on 3 June for 14 units of "
                        "the K-200 valve at 38 euros each, payable within 30 days.")
    n = len(ids)
    at_p = engine.prefill(ids, torch.arange(p, p + n)).kv
    at_q = engine.prefill(ids, torch.arange(q, q + n)).kv
    moved = reposition(engine.rope, at_p, q - p)
    assert torch.equal(moved.positions, at_q.positions)
    assert torch.equal(moved.values, at_p.values)             # values untouched
    rel = float((moved.keys - at_q.keys).norm() / at_q.keys.norm())
    assert rel < 1e-4, rel
    # and not trivially: un-rotated keys are far off
    assert float((at_p.keys - at_q.keys).norm() / at_q.keys.norm()) > 0.1


@pytest.mark.slow
def test_self_test_failure_really_disables_reposition(smol):
    """A wrong rotation table fails the startup self-test, and then nothing repositions."""
    broken = RopeTable(smol.rope.inv_freq * 1.01, smol.rope.head_dim)   # 1% frequency error
    assert self_test(smol, broken) is False
    assert broken.enabled is False and broken.self_test_error > 1e-4
    chunk = smol.prefill(smol.encode("A short chunk of text."), torch.arange(1, 7)).kv
    with pytest.raises(RepositionDisabled):
        reposition(broken, chunk, 10)
    # the engine path: an engine whose table failed refuses to compose by reposition
    good = smol.rope
    try:
        smol.rope = broken
        with pytest.raises(RepositionDisabled):
            compose(smol, [TextSegment(smol.encode("Hi")), ChunkSegment(chunk)])
    finally:
        smol.rope = good
    assert self_test(smol, good) is True                     # the real table passes


@pytest.mark.slow
def test_engine_without_self_test_never_trusts_rotation():
    from kvruntime.engine import ReferenceEngine

    e = ReferenceEngine("smollm2-135m", run_self_test=False)
    assert e.rope.enabled is False
    with pytest.raises(RepositionDisabled):
        e.rope.rotate(torch.zeros(e.num_layers, e.kv_heads, 1, e.head_dim), 1)


@pytest.mark.slow
def test_bf16_engine_passes_its_self_test_so_reposition_stays_on(one_torch_thread):
    """bf16 keys are rounded to bf16 (and the model's cos/sin too): the self-test's 16-bit tolerance
    (kvruntime.rope.self_test_tolerance) must accept that, or bf16 deployments silently lose reposition.
    The forward's drift through the layers no longer enters it (tests/test_rope_selftest.py)."""
    from kvruntime.engine import ReferenceEngine
    e = ReferenceEngine("smollm2-135m", dtype="bfloat16", threads=1)
    assert e.rope.enabled, e.rope.self_test_error
    assert 1e-3 < e.rope.self_test_error < 3e-2
