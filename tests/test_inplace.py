"""The engine writes a request's KV in place (kvruntime.inplace, kvruntime.ops.build).

Every forward writes its K/V into slots of one buffer and attends to it there. These tests hold
the in-place path to the model's own Hugging Face forward (all 7 tiny families and both shipped
models, fp32 CPU), and to the path it replaced -- a ``DynamicCache`` built from the context with
transformers' own attention and the engine's explicit mask (``_old_prefill`` below, the engine's
``prefill`` before this change) -- for seam repair, selective recompute, the erratum and
edit-in-place; and prove that seam repair, the question and the erratum never copy the context.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import get_engine, tiny_engine

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
SHIPPED = ["smollm2-135m", "gemma3-270m"]


def _engine(request, name):
    if name in SHIPPED:
        return get_engine(name)
    return tiny_engine(request.getfixturevalue("tiny_checkpoints"), name)


_HF: dict = {}


def _hf(e):
    """The same checkpoint loaded by transformers with its own attention (sdpa, or eager for
    soft-capping): the reference the in-place path is held to."""
    import transformers
    from kvruntime.checkpoint import ensure_checkpoint
    key = e.spec.name
    if key not in _HF:
        _HF[key] = transformers.AutoModelForCausalLM.from_pretrained(
            ensure_checkpoint(e.spec), dtype=torch.float32, attn_implementation=e.arch.attn_implementation).eval()
    return _HF[key]


@torch.inference_mode()
def _old_prefill(e, ids, pos, past):
    """The engine's prefill before this change: the context copied into a DynamicCache, HF's own
    attention (GQA expanded, explicit additive mask by position)."""
    from transformers import DynamicCache
    from kvruntime.kv import KVCache
    ids = torch.as_tensor(ids, dtype=torch.long)
    pos = torch.as_tensor(pos, dtype=torch.long)
    n_past = past.num_tokens
    cache = DynamicCache(ddp_cache_data=past.to_legacy()) if n_past else DynamicCache()
    mask = e._mask(pos, torch.cat([past.positions, pos]))
    out = _hf(e)(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, past_key_values=cache,
                 use_cache=True, logits_to_keep=1)
    data = torch.stack([torch.stack([cache.layers[i].keys[0, :, n_past:], cache.layers[i].values[0, :, n_past:]])
                        for i in range(e.num_layers)])
    return out.logits[0, -1], KVCache(data, pos, ids)


def _close(a, b, tol):
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


def _ids(e, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(500, e.model.config.vocab_size), (n,), generator=g).tolist()


@pytest.mark.parametrize("name", FAMILIES + SHIPPED)
def test_chunked_recompute_in_one_buffer_equals_the_models_own_forward(request, name):
    from kvruntime.ops import recompute
    e = _engine(request, name)
    ids = _ids(e, 96)
    with torch.inference_mode():
        ref = _hf(e)(input_ids=torch.tensor([ids]), use_cache=True)
    out = recompute(e, ids, chunk_size=40)
    tol = 2e-5 if name in SHIPPED else 1e-5
    _close(out.logits, ref.logits[0, -1], tol)
    for i in range(e.num_layers):
        keys = ref.past_key_values.layers[i].keys[0]           # a sliding cache keeps only its window
        _close(out.kv.data[i, 0, :, -keys.shape[1]:], keys, tol)
        _close(out.kv.data[i, 1, :, -keys.shape[1]:], ref.past_key_values.layers[i].values[0], tol)


@pytest.mark.parametrize("name", FAMILIES + SHIPPED)
def test_seam_repair_erratum_and_edit_equal_the_path_they_replaced(request, name):
    from kvruntime.kv import KVCache
    from kvruntime.ops import edit_in_place, erratum, precompile_chunk
    from kvruntime.ops.blend import recompute_slots
    from kvruntime.ops.compose import ChunkSegment, TextSegment, compose
    e = _engine(request, name)
    tol = 5e-5 if name in SHIPPED else 2e-5
    a, b, q = _ids(e, 40, 1), _ids(e, 30, 2), _ids(e, 6, 3)
    ca, cb = precompile_chunk(e, a), precompile_chunk(e, b)
    res = compose(e, [ChunkSegment(ca), ChunkSegment(cb), TextSegment(q)], seam_tokens=2)
    # the old path: reposition, cat, then the seams recomputed against the rest (DynamicCache)
    from kvruntime.ops.compose import reposition
    moved = KVCache.cat([reposition(e.rope, ca, -int(ca.positions[0])), reposition(e.rope, cb, 40 - int(cb.positions[0]))])
    seams = [0, 1, 40, 41]
    keep = torch.tensor([i not in seams for i in range(70)])
    _, fresh = _old_prefill(e, moved.token_ids[seams], moved.positions[seams], moved.select(torch.nonzero(keep).flatten()))
    old = moved.data.clone()
    old[:, :, :, seams] = fresh.data
    _close(res.kv.data[:, :, :, :70], old, tol)
    ctx = KVCache(old, moved.positions, moved.token_ids)
    lq, kq = _old_prefill(e, q, torch.arange(70, 76), ctx)
    _close(res.logits, lq, tol)
    _close(res.kv.data[:, :, :, 70:], kq.data, tol)
    # selective recompute of given slots, in place
    got = recompute_slots(e, ctx, [3, 17, 50])
    keep = torch.tensor([i not in (3, 17, 50) for i in range(70)])
    _, fresh = _old_prefill(e, ctx.token_ids[[3, 17, 50]], ctx.positions[[3, 17, 50]],
                            ctx.select(torch.nonzero(keep).flatten()))
    _close(got.data[:, :, :, [3, 17, 50]], fresh.data, tol)
    # the erratum
    fix = erratum(e, ctx, "price", "10", "12")
    lo, ko = _old_prefill(e, fix.token_ids, torch.arange(70, 70 + len(fix.token_ids)), ctx)
    _close(fix.logits, lo, tol)
    _close(fix.kv.data[:, :, :, 70:], ko.data, tol)
    _close(fix.kv.data[:, :, :, :70], ctx.data, 0)
    # edit in place, every downstream token recomputed: the whole edited context recomputed
    full = _ids(e, 50, 4)
    cached = KVCache.cat([_old_prefill(e, full, torch.arange(50), ctx.slice(0, 0))[1]])
    new = _ids(e, 3, 5)
    ed = edit_in_place(e, cached, (10, 12), new, top_k=10 ** 6)
    _, want = _old_prefill(e, full[:10] + new + full[12:], torch.arange(51), ctx.slice(0, 0))
    _close(ed.kv.data, want.data, tol)


def test_seam_repair_question_and_erratum_write_into_the_buffer_without_copying_the_context(
        request, monkeypatch):
    from kvruntime.ops import erratum, precompile_chunk
    from kvruntime.ops.build import Builder
    e = _engine(request, "llama3")
    a, b, q = _ids(e, 150, 1), _ids(e, 150, 2), _ids(e, 7, 3)
    ca, cb = precompile_chunk(e, a), precompile_chunk(e, b)
    room = 64
    bld = Builder(e, 300 + len(q) + room)
    bld.reposition(ca, -int(ca.positions[0]))
    bld.mark_seam()
    bld.reposition(cb, 150 - int(cb.positions[0]))
    n = bld.length
    ptr = bld.buf.data.untyped_storage().data_ptr()
    before = bld.buf.data[:, :, :, :n].clone()
    seen = []
    real_cat = torch.cat

    def spy(tensors, *args, **kw):
        seen.extend(tuple(t.shape) for t in tensors)
        return real_cat(tensors, *args, **kw)
    monkeypatch.setattr(torch, "cat", spy)
    res = bld.flush(seam_tokens=2)                     # seam repair, in place
    logits = bld.compute(q, logits=True)               # the question after the context
    fix = erratum(e, bld, "price", "10", "12")         # the erratum after the question
    monkeypatch.setattr(torch, "cat", real_cat)
    assert res.recomputed_slots == [150, 151]
    assert bld.buf.data.untyped_storage().data_ptr() == ptr
    assert fix.kv.data.untyped_storage().data_ptr() == ptr
    assert fix.kv.num_tokens == n + len(q) + len(fix.token_ids) and logits is not None
    # the seams (and only they) changed in place
    changed = (bld.buf.data[:, :, :, :n] != before).flatten(0, 2).any(0).any(-1)
    assert changed.nonzero().flatten().tolist() == [150, 151]
    assert seen, "the spy saw no torch.cat at all (it is not wired in)"
    big = [s for s in seen if any(d >= n for d in s if d != e.model.config.vocab_size)]
    assert not big, f"torch.cat saw the context: {big}"


def test_few_token_forward_reads_the_cache_in_place_no_mask_and_no_gqa_expansion(request, monkeypatch):
    """A question block at the end of the buffer runs with no mask (lower-right causal) and
    SDPA's own GQA (keys handed over as views of the buffer, kv_heads wide)."""
    import torch.nn.functional as F
    e = _engine(request, "llama3")
    assert e.model.config.num_attention_heads > e.kv_heads
    from kvruntime.ops.build import Builder
    bld = Builder(e, 120)
    bld.compute(_ids(e, 100))
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[2], k.shape[1], k.shape[2], attn_mask, kw.get("enable_gqa"),
                      k.untyped_storage().data_ptr()))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    bld.compute(_ids(e, 1, 7))
    bld.compute(_ids(e, 4, 8), logits=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    ptr = bld.buf.data.untyped_storage().data_ptr()
    one, four = calls[:e.num_layers], calls[e.num_layers:]
    assert all(c[0] == 1 and c[1] == e.kv_heads and c[2] == 101 and c[3] is None and c[4] and c[5] == ptr
               for c in one)
    # four queries: a [4 x 105] lower-right causal boolean mask, no larger
    assert all(c[0] == 4 and c[2] == 105 and tuple(c[3].shape[-2:]) == (4, 105) and c[3].dtype == torch.bool
               for c in four)
