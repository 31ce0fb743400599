"""The fused re-rotation (kvruntime.rope.rotate_fused: native kernel and torch ops) against the
fp64 reference rotate_keys, within fp32 rounding, for every layout and destination the repo uses.

Tolerance, per element y_j of a rotated pair (x_j, x_j+half): cos/sin cast to fp32 (<= u |x|
each), two products (<= u each), one sum (<= u), and the reference's own cast to fp32 (<= u/2):
|fused - ref| <= 3.5 u (|x_j| + |x_j+half|) = 1.75 eps32 (...), u = eps32 / 2. The test allows
2 eps32 (second-order terms). 16-bit keys: the two results may round to adjacent 16-bit values,
so one 16-bit ulp of the reference more."""
import shutil

import pytest
import torch

from kvruntime import rope_native
from kvruntime.kv import KVCache
from kvruntime.ops import reposition
from kvruntime.rope import RopeTable, rotate_fused, rotate_keys

EPS32 = torch.finfo(torch.float32).eps


def _inv(layers, head_dim, rotary_dim, bases):
    half = rotary_dim // 2
    rows = [1.0 / b ** (torch.arange(half, dtype=torch.float64) * 2 / rotary_dim) for b in bases]
    return torch.stack([rows[i % len(rows)] for i in range(layers)])


LAYOUTS = {   # name: (layers, kv_heads, head_dim, rotary_dim, bases)
    "smollm2-like (shared inv_freq)": (4, 3, 64, 64, [100000.0]),
    "gemma3-like (sliding 1e4 / global 1e6)": (6, 1, 32, 32, [1e4, 1e4, 1e6]),
    "partial rotary (16 of 32 dims)": (3, 2, 32, 16, [1e4]),
}
DELTAS = {"+1234": 1234, "-987": -987, "per-token mixed": "tokens"}


def _keys(layers, heads, n, head_dim, dtype=torch.float32, seed=0):
    """Keys as the KV layout holds them: a strided view data[:, 0] of [L, 2, H, n, D]."""
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(layers, 2, heads, n, head_dim, generator=g, dtype=torch.float64) * 3).to(dtype)
    return data[:, 0]


def _bound(keys, rot):
    """2 eps32 (|x_j| + |x_j+half|) on rotated dims, 0 past rotary_dim."""
    x = keys.to(torch.float64)
    half = rot // 2
    pair = x[..., :half].abs() + x[..., half:rot].abs()
    return torch.cat([pair, pair, torch.zeros_like(x[..., rot:])], -1) * 2 * EPS32


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("dest", ["new", "out", "in_place"])
@pytest.mark.parametrize("delta_name", list(DELTAS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_equals_fp64_reference_within_fp32_rounding(impl, dest, delta_name, layout):
    layers, heads, head_dim, rot, bases = LAYOUTS[layout]
    n = 37
    inv = _inv(layers, head_dim, rot, bases)
    keys = _keys(layers, heads, n, head_dim)
    delta = DELTAS[delta_name]
    if delta == "tokens":
        delta = torch.arange(n) * 97 - 1800                       # both signs, one per slot
    ref = rotate_keys(keys, delta, inv)
    original = keys.clone()
    if dest == "new":
        got = rotate_fused(keys, delta, inv, impl=impl)
    elif dest == "out":                                           # a slot range of a bigger buffer
        buf = torch.full((layers, 2, heads, n + 5, head_dim), float("nan"))
        got = rotate_fused(keys, delta, inv, out=buf[:, 0, :, 2:2 + n], impl=impl)
        assert got.data_ptr() == buf[:, 0, :, 2:].data_ptr()
        assert torch.isnan(buf[:, 0, :, :2]).all() and torch.isnan(buf[:, 0, :, 2 + n:]).all()
        assert torch.isnan(buf[:, 1]).all()                       # nothing written outside out
    else:
        got = rotate_fused(keys, delta, inv, out=keys, impl=impl)
        assert got.data_ptr() == keys.data_ptr()
    err = (got.to(torch.float64) - ref.to(torch.float64)).abs()
    assert bool((err <= _bound(original, rot)).all()), float((err - _bound(original, rot)).max())
    assert torch.equal(got[..., rot:], original[..., rot:])       # dims past rotary_dim untouched
    if dest != "in_place":
        assert torch.equal(keys, original)                        # the source is only read
    assert float((got - original).abs().max()) > 0.1              # and it really rotated


def test_auto_uses_the_native_kernel_where_a_compiler_exists():
    if shutil.which("cc") or shutil.which("gcc"):
        assert rope_native.status() == "native"
    else:
        assert rope_native.status().startswith("torch (")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_16bit_keys_rotate_in_fp32_and_come_back_in_their_dtype(dtype, impl):
    layers, heads, head_dim, rot, bases = LAYOUTS["gemma3-like (sliding 1e4 / global 1e6)"]
    inv = _inv(layers, head_dim, rot, bases)
    keys = _keys(layers, heads, 29, head_dim, dtype)
    for delta in (3001, -2500, torch.arange(29) * 41 - 600):
        ref = rotate_keys(keys, delta, inv)
        for got in (rotate_fused(keys, delta, inv, impl=impl), rotate_fused(keys.clone(), delta, inv, impl=impl,
                                                                            out=None)):
            assert got.dtype == dtype
            err = (got.double() - ref.double()).abs()
            bound = torch.finfo(dtype).eps * ref.double().abs() + _bound(keys, rot)
            assert bool((err <= bound).all())
        k = keys.clone()
        rotate_fused(k, delta, inv, out=k, impl=impl)
        assert bool(((k.double() - ref.double()).abs() <= bound).all())


def test_rotation_rejects_bad_arguments():
    inv = _inv(2, 16, 16, [1e4])
    keys = _keys(2, 1, 6, 16)
    with pytest.raises(ValueError):
        rotate_fused(keys, torch.tensor([1, 2]), inv)                  # delta length
    with pytest.raises(ValueError):
        rotate_fused(keys, 1, inv, out=torch.empty(2, 1, 5, 16))       # out shape
    with pytest.raises(ValueError):
        buf = keys.clone()
        rotate_fused(buf[:, :, 1:], 1, inv[:, :], out=buf[:, :, :-1])  # overlapping, not identical
    with pytest.raises(ValueError):
        rotate_fused(keys, 1, inv, impl="cuda-magic")
    with pytest.raises(ValueError):
        rotate_fused(keys, 1, _inv(3, 16, 16, [1e4]))                  # layer count


def test_reposition_writes_the_moved_chunk_into_a_given_buffer():
    layers, heads, head_dim, rot, bases = LAYOUTS["smollm2-like (shared inv_freq)"]
    table = RopeTable(_inv(layers, head_dim, rot, bases), head_dim)
    g = torch.Generator().manual_seed(1)
    chunk = KVCache(torch.randn(layers, 2, heads, 9, head_dim, generator=g), torch.arange(1, 10),
                    torch.arange(100, 109))
    buf = torch.zeros(layers, 2, heads, 12, head_dim)
    moved = reposition(table, chunk, 500, out=buf[:, :, :, 3:])
    assert moved.data.data_ptr() == buf[:, :, :, 3:].data_ptr()
    assert torch.equal(moved.positions, torch.arange(501, 510)) and torch.equal(moved.token_ids, chunk.token_ids)
    assert torch.equal(buf[:, 1, :, 3:], chunk.values) and not buf[:, :, :, :3].any()
    ref = rotate_keys(chunk.keys, 500, table.inv_freq)
    assert bool(((buf[:, 0, :, 3:] - ref).abs() <= _bound(chunk.keys, rot)).all())
    assert torch.equal(reposition(table, chunk, 500).data, buf[:, :, :, 3:])   # the allocating form agrees
