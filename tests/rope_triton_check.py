"""The Triton re-rotation kernel against the fp64 reference, for every layout, delta and destination
of tests/test_rope_fused.py, in fp32, bf16 and fp16. Run by tests/test_rope_triton.py: in a
subprocess under ``TRITON_INTERPRET=1`` on CPU tensors (no GPU needed), and in process on CUDA.
``python tests/rope_triton_check.py [cpu|cuda]`` prints ``ok <cases>`` or fails an assert."""
from __future__ import annotations

import sys

import torch

from kvruntime.rope import rotate_fused, rotate_keys
from tests.test_rope_fused import DELTAS, LAYOUTS, _bound, _inv, _keys


def check(device: str = "cpu") -> int:
    cases = 0
    for layout, (layers, heads, head_dim, rot, bases) in LAYOUTS.items():
        n = 37
        inv = _inv(layers, head_dim, rot, bases)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            keys = _keys(layers, heads, n, head_dim, dtype).to(device)
            for delta in DELTAS.values():
                if delta == "tokens":
                    delta = torch.arange(n) * 97 - 1800
                ref = rotate_keys(keys.cpu(), delta, inv).double()
                bound = _bound(keys.cpu(), rot)
                if dtype != torch.float32:        # the two may round to adjacent 16-bit values
                    bound = bound + torch.finfo(dtype).eps * ref.abs()
                original = keys.clone()
                buf = torch.full((layers, 2, heads, n + 5, head_dim), float("nan"), dtype=dtype, device=device)
                dst = buf[:, 0, :, 2:2 + n]
                k = keys.clone()
                for name, got in (("new", rotate_fused(keys, delta, inv, impl="triton")),
                                  ("slots", rotate_fused(keys, delta, inv, out=dst, impl="triton")),
                                  ("in place", rotate_fused(k, delta, inv, out=k, impl="triton"))):
                    err = (got.cpu().double() - ref).abs()
                    assert bool((err <= bound).all()), (layout, dtype, name, float((err - bound).max()))
                    assert torch.equal(got[..., rot:].cpu(), original[..., rot:].cpu()), (layout, dtype, name)
                    assert float((got.cpu().double() - original.cpu().double()).abs().max()) > 0.1
                    cases += 1
                assert dst.data_ptr() == buf[:, 0, :, 2:].data_ptr() and k.data_ptr() != keys.data_ptr()
                assert torch.isnan(buf[:, 0, :, :2]).all() and torch.isnan(buf[:, 0, :, 2 + n:]).all()
                assert torch.isnan(buf[:, 1]).all()                   # nothing written outside the slots
                assert torch.equal(keys, original)                    # the source is only read
    return cases


if __name__ == "__main__":
    print("ok", check(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
