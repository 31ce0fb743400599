"""The GPU re-rotation (kvruntime.rope_triton): its math equals the fp64 reference (the kernel run by
Triton's interpreter on CPU tensors, and on CUDA where a device is present), and rotate_fused
dispatches by device: CPU keys never reach it, CUDA keys of the kernel's dtypes do."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvruntime import rope_triton
from kvruntime.rope import rotate_fused, rotate_keys, rotation_path
from tests.test_rope_fused import _inv, _keys

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None   # CUDA torch builds ship it; CPU ones may not


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed: GPU rotations then run torch ops")
def test_kernel_math_equals_the_fp64_reference_under_the_interpreter():
    r = _run("from tests.rope_triton_check import check; print('ok', check('cpu'))", TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", str(3 * 3 * 3 * 3)]       # layouts x dtypes x deltas x destinations


def test_dispatch_by_device_and_dtype():
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    assert rotation_path("cpu", f32, f32) == "native"
    assert rotation_path("cpu", bf16, bf16) == "torch"
    assert rotation_path("cuda", bf16, bf16) == "triton"
    assert rotation_path("cuda", f32, f16) == "triton"
    assert rotation_path("cuda", f64, f64) == "torch"
    assert rotation_path("cuda", bf16, bf16, "torch") == "torch"
    assert rotation_path("cpu", f32, f32, "triton") == "triton"


def test_cpu_keys_never_reach_the_gpu_kernel(monkeypatch):
    def _boom(*a, **k):
        raise AssertionError("the Triton kernel was called for CPU keys")
    monkeypatch.setattr(rope_triton, "rotate", _boom)
    inv = _inv(3, 32, 32, [1e4, 1e6])
    for dtype in (torch.float32, torch.bfloat16):
        keys = _keys(3, 2, 11, 32, dtype)
        got = rotate_fused(keys, 321, inv)
        assert (got.double() - rotate_keys(keys, 321, inv).double()).abs().max() < 0.05


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    assert not rope_triton.interpreted()
    with pytest.raises(ValueError, match="impl='triton' cannot rotate"):
        rotate_fused(_keys(2, 1, 4, 16), 5, _inv(2, 16, 16, [1e4]), impl="triton")


def test_kernel_can_be_switched_off():
    r = _run("from kvruntime import rope_triton; print(rope_triton.status())", KVNOTES_TRITON_ROPE="0")
    assert r.returncode == 0 and r.stdout.strip() == "torch (disabled by KVNOTES_TRITON_ROPE=0)", r.stderr[-2000:]
    assert rope_triton.status() == "triton" if HAS_TRITON else rope_triton.status().startswith("torch (")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_on_cuda_equals_the_fp64_reference():
    from tests.rope_triton_check import check
    assert check("cuda") == 81
