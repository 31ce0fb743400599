"""The in-place engine on CUDA, all 7 tiny families: fp32 on the GPU gives what fp32 on the CPU gives
for a chunked recompute (later chunks run lower-right causal over the buffer: on CUDA a
``causal_lower_right`` bias, the flash kernel, no mask), a composition with reposition and seam
repair, an erratum + question and edit-in-place; bf16 stays finite. Skipped where CUDA is not
available (CI has no GPU); run on a lent device (bench/gpu_check.sh)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_engine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
TOL = 1e-4      # relative to the largest magnitude: fp32 on different kernels, same arithmetic


def _close(a, b, what):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = max(1.0, float(b.abs().max()))
    err = float((a - b).abs().max()) / scale
    assert err <= TOL, f"{what}: relative error {err:.2e}"


def _ids(e, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(500, e.model.config.vocab_size), (n,), generator=g).tolist()


def _run(e):
    from kvruntime.ops import ChunkSegment, TextSegment, compose, edit_in_place, erratum, precompile_chunk, recompute
    from kvruntime.ops.build import Builder
    ids = _ids(e, 120, 0)
    rec = recompute(e, ids, chunk_size=32)                 # chunks 2..4: q < keys, lower-right causal
    ca, cb, q = precompile_chunk(e, ids[:50]), precompile_chunk(e, ids[50:90]), _ids(e, 7, 1)
    comp = compose(e, [ChunkSegment(ca), ChunkSegment(cb), TextSegment(q)], seam_tokens=2)
    b = Builder(e, 120 + 64 + len(q))
    b.append(rec.kv)
    fix = erratum(e, b, "price", "10 euros", "12 euros")
    qlog = b.compute(q, logits=True)
    new = _ids(e, 3, 2)
    # every downstream token recomputed: a top-16 pick can differ by device where deviations tie
    # (a sliding window leaves tokens past it at exactly 0 at the probe layer on the CPU)
    ed = edit_in_place(e, rec.kv, (10, 13), new, 10 ** 6)
    top = {} if e.sliding_window else {"edit top-16 kv": edit_in_place(e, rec.kv, (10, 13), new, 16).kv.data}
    return {**top,"recompute logits": rec.logits, "recompute kv": rec.kv.data,
            "compose logits": comp.logits, "compose kv": comp.kv.data,
            "erratum logits": fix.logits, "erratum kv": b.kv.data, "question logits": qlog,
            "edit kv": ed.kv.data}


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_fp32_equals_cpu_fp32(tiny_checkpoints, family):
    cpu = tiny_engine(tiny_checkpoints, family)
    gpu = tiny_engine(tiny_checkpoints, family, device="cuda")
    assert next(gpu.model.parameters()).device.type == "cuda"
    want, got = _run(cpu), _run(gpu)
    assert got["compose kv"].device.type == "cuda"
    for k in want:
        _close(got[k], want[k], f"{family} {k}")


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_runs_and_stays_finite(tiny_checkpoints, family):
    e = tiny_engine(tiny_checkpoints, family, dtype="bfloat16", device="cuda")
    assert e.rope.enabled, e.rope.self_test_error
    for k, v in _run(e).items():
        assert v.dtype in (torch.bfloat16, torch.float32) and bool(torch.isfinite(v).all()), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q,n", [(16, 4096), (45, 3000), (300, 300 + 1024)])
def test_lower_right_blocks_on_cuda_equal_the_materialized_mask(dtype, q, n):
    """The causal_lower_right form attend() passes on CUDA (GQA 32/8) = SDPA with the boolean mask."""
    import torch.nn.functional as F

    from kvruntime.inplace import attend, causal_tail_mask
    g = torch.Generator(device="cuda").manual_seed(0)
    qs = torch.randn(1, 32, q, 128, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, 8, n, 128, device="cuda", dtype=dtype, generator=g)
    got, _ = attend(None, qs, k, v, None, scaling=0.088)
    m = causal_tail_mask(q, n, None, "cuda")[None, None]
    want = F.scaled_dot_product_attention(qs.float(), k.float(), v.float(), attn_mask=m, scale=0.088,
                                          enable_gqa=True).transpose(1, 2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert float((got.float() - want).abs().max()) <= tol
