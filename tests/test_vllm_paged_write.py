"""The connector's write into vLLM's paged CPU cache (issue 47 item 3): whole blocks copied with
torch where a probe found the backend's own op writes the layout the copy assumes, the rest through
the op; the cache must end up exactly as the op alone leaves it (real vLLM CPU backend, no engine)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

HEADS, DIM, BS, BLOCKS = 3, 64, 128, 24


def _layer(dtype):
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa
    impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype)
    return SimpleNamespace(impl=impl, kv_cache=cache, isa=_get_attn_isa(dtype, BS, DIM),
                           _k_scale_float=1.0, _v_scale_float=1.0)


def _writer(layers):
    from decode_workers.vllm_adapter import PagedCacheWriter
    ctx = SimpleNamespace(no_compile_layers={f"model.layers.{i}.attn": x for i, x in enumerate(layers)})
    return PagedCacheWriter(ctx, list(ctx.no_compile_layers))


def _slots(start: int, tokens: int, block_ids: list[int]) -> torch.Tensor:
    """vLLM's slot mapping of positions [start, start + tokens) over ``block_ids``."""
    return torch.tensor([block_ids[p // BS] * BS + p % BS for p in range(start, start + tokens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,tokens", [(0, 4 * BS), (0, 5 * BS - 37), (BS + 5, 3 * BS), (7, 40)])
def test_block_copy_writes_what_the_backend_op_writes(dtype, start, tokens):
    try:
        _layer(dtype)
    except ImportError:                                     # pragma: no cover - another vLLM layout
        pytest.skip("vLLM's CPU attention backend is not importable here")
    layers, want = [_layer(dtype) for _ in range(2)], [_layer(dtype) for _ in range(2)]
    w, ref = _writer(layers), _writer(want)
    g = torch.Generator().manual_seed(start + tokens)
    block_ids = torch.randperm(BLOCKS, generator=g).tolist()         # scattered blocks, as vLLM's are
    data = torch.randn(2, 2, HEADS, tokens + 9, DIM, generator=g).to(dtype)
    slots = _slots(start, tokens, block_ids)
    runs = w.runs(slots)
    for i in range(2):
        k, v = (data[i, j, :, 9:] for j in (0, 1))                   # a slice, as the block's tokens are
        w.write_layer(i, k, v, slots, runs)
        ref.write(i, k.transpose(0, 1), v.transpose(0, 1), slots)
    for got, exp in zip(layers, want):
        assert exp.kv_cache.abs().sum() > 0
        assert torch.equal(got.kv_cache, exp.kv_cache)
    if dtype == torch.float32:           # the layout the copy knows: it must be found, else this test proves nothing
        assert w.layout == "keys_transposed"
        whole = max(0, (tokens - (BS - start % BS) % BS) // BS)
        assert runs.tail - runs.head == whole * BS


def test_slots_out_of_block_order_are_written_by_the_op_alone():
    w = _writer([_layer(torch.float32)])
    slots = _slots(0, 2 * BS, [3, 5]).flip(0)                        # not each block's slots in order
    assert w.runs(slots).tail == 0
    assert w.runs(_slots(0, BS - 1, [3])).tail == 0                  # no whole block


def test_layers_of_another_layout_leave_every_layer_to_the_op():
    layers = [_layer(torch.float32), _layer(torch.float32)]
    layers[1].kv_cache = torch.zeros(BLOCKS, HEADS, BS // 2, 2 * DIM)         # another block size
    assert _writer(layers).layout is None
    assert _writer(layers[:1]).layout == "keys_transposed"
