"""Selective recompute of composed chunks on the real models, against full recompute."""
import pytest
import torch

from kvruntime.fidelity.metrics import kl_divergence
from kvruntime.ops import ChunkSegment, TextSegment, blend_count, compose, precompile_chunk, recompute
from kvruntime.ops.blend import selective_recompute

A = ("Harbor Lane Bakery reported revenue of 4.2 million dollars in 2025, up from 3.1 million. "
     "Its head baker is Ines Duarte.\n\n")
B = ("Harbor Line Bakeries reported revenue of 7.9 million dollars in 2025, down from 8.4 million. "
     "Its head baker is Tomas Reyes.\n\n")
Q = "What revenue did Harbor Lane Bakery report in 2025?"


def _segments(engine):
    pre, a, b, q = engine.encode("Notes:\n"), engine.encode(A), engine.encode(B), engine.encode(Q)
    segs = [TextSegment(pre), ChunkSegment(precompile_chunk(engine, a)), ChunkSegment(precompile_chunk(engine, b)),
            TextSegment(q)]
    return segs, pre + a + b + q


@pytest.mark.slow
def test_ratio_one_is_full_recompute_and_ratio_zero_is_reposition_plus_seam(engine):
    segs, ids = _segments(engine)
    full = recompute(engine, ids)
    all_ = compose(engine, segs, seam_tokens=1, recompute_ratio=1.0)
    assert all_.kv.token_ids.tolist() == ids and all_.kv.positions.tolist() == list(range(len(ids)))
    assert torch.allclose(all_.kv.data, full.kv.data, atol=5e-4), float((all_.kv.data - full.kv.data).abs().max())
    assert kl_divergence(full.logits, all_.logits) < 1e-6
    assert all_.reused_tokens == 0 and all_.probed_tokens == 0      # r=1 needs no probe
    seam = compose(engine, segs, seam_tokens=1)
    zero = compose(engine, segs, seam_tokens=1, recompute_ratio=0.0)
    assert torch.equal(zero.kv.data, seam.kv.data) and torch.equal(zero.logits, seam.logits)
    assert zero.computed_tokens == seam.computed_tokens and zero.probed_tokens == 0


@pytest.mark.slow
def test_partial_ratio_recomputes_the_counted_share_and_moves_toward_recompute(smol):
    segs, ids = _segments(smol)
    full = recompute(smol, ids)
    seam = compose(smol, segs, seam_tokens=1)
    half = compose(smol, segs, seam_tokens=1, recompute_ratio=0.5)
    chunk_tokens = sum(s.kv.num_tokens for s in segs if isinstance(s, ChunkSegment))
    extra = blend_count(0.5, chunk_tokens - 2)                      # 2 seam slots are always recomputed
    assert half.computed_tokens == seam.computed_tokens + extra
    assert half.reused_tokens == seam.reused_tokens - extra and half.probed_tokens == chunk_tokens
    # KV distance over the chunk slots to the full recompute shrinks (a real outcome of recomputing
    # the most deviating half; the fidelity curve itself is measured in docs/fidelity.md, not asserted)
    s = slice(len(segs[0].token_ids), len(segs[0].token_ids) + chunk_tokens)
    d_seam = float(((seam.kv.data[:, :, :, s] - full.kv.data[:, :, :, s]) ** 2).sum())
    d_half = float(((half.kv.data[:, :, :, s] - full.kv.data[:, :, :, s]) ** 2).sum())
    assert d_half < 0.6 * d_seam, (d_half, d_seam)


@pytest.mark.slow
def test_probe_picks_the_slots_that_deviate_most(smol):
    """The chosen slots are the ones whose layer-1 KV moves most when the context is seen."""
    segs, ids = _segments(smol)
    comp = compose(smol, segs[:3], seam_tokens=0)          # pre + two chunks, unrepaired
    start = len(segs[0].token_ids)
    res = selective_recompute(smol, comp.kv, start, 0.1)   # default probe: kv1
    tail = comp.kv.slice(start)
    probe = smol.prefill(tail.token_ids, tail.positions, comp.kv.slice(0, start), stop_after_layer=1).kv
    dev = ((probe.data[1] - tail.data[1]) ** 2).sum(dim=(0, 1, 3))
    k = blend_count(0.1, tail.num_tokens)
    expect = sorted(int(i) + start for i in torch.topk(dev, k).indices)
    assert res.recomputed_slots == expect and res.probed_tokens == tail.num_tokens
    untouched = [i for i in range(comp.kv.num_tokens) if i not in expect]
    assert torch.equal(res.kv.data[:, :, :, untouched], comp.kv.data[:, :, :, untouched])


@pytest.mark.slow
def test_bad_ratio_and_ranges_are_refused(smol):
    kv = recompute(smol, smol.encode("Some cached text here."), logits=False).kv
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            blend_count(bad, 10)
    with pytest.raises(ValueError):
        selective_recompute(smol, kv, kv.num_tokens + 1, 0.5)
    with pytest.raises(ValueError):
        selective_recompute(smol, kv, 1, 0.5, seam_slots=[0])
    with pytest.raises(ValueError):
        compose(smol, [TextSegment(smol.encode("x"))], recompute_ratio=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["kv1", "kv4", "progressive"])
def test_corrupted_slots_are_found_and_restored_to_the_full_context_kv(smol, probe):
    """Start from the exact whole-context KV and corrupt a few chunk slots in every layer: each probe
    must rank exactly those slots highest, and recomputing them (attending to the others' cached
    KV and to each other's fresh KV, by position) must give back the full recompute's KV. This
    checks the probe and the recompute's attention pattern against an exact oracle."""
    segs, ids = _segments(smol)
    start = len(segs[0].token_ids)
    ctx = ids[: len(ids) - len(segs[-1].token_ids)]          # prefix + chunks, no question
    exact = recompute(smol, ctx, logits=False).kv
    n_chunk = exact.num_tokens - start
    bad = sorted({start + 3, start + 11, start + n_chunk // 2, exact.num_tokens - 2})
    data = exact.data.clone()
    g = torch.Generator().manual_seed(0)
    data[:, :, :, bad] += torch.randn(data[:, :, :, bad].shape, generator=g) * 2.0
    corrupted = type(exact)(data, exact.positions, exact.token_ids)
    ratio = len(bad) / n_chunk
    res = selective_recompute(smol, corrupted, start, ratio, probe=probe)
    assert res.recomputed_slots == bad
    assert torch.allclose(res.kv.data, exact.data, atol=5e-4), float((res.kv.data - exact.data).abs().max())
    assert torch.equal(corrupted.data, data)                  # not in place: the caller's buffer is kept
    layers = {"kv1": 1, "kv4": 4}.get(probe)
    if layers:                                                # tokens x full layers (the last one stops at its K/V)
        assert res.probe_token_layers == layers * (exact.num_tokens - start)
    else:                                                     # refined at layers 2 and 3 beyond the layer-1 probe
        assert res.probe_token_layers > exact.num_tokens - start
    inplace = selective_recompute(smol, corrupted, start, ratio, probe=probe, in_place=True)
    assert inplace.kv.data.data_ptr() == corrupted.data.data_ptr()
    assert torch.allclose(corrupted.data, exact.data, atol=5e-4)


@pytest.mark.slow
def test_probe_is_shared_across_ratios_and_bad_probes_are_refused(smol):
    segs, ids = _segments(smol)
    cache: dict = {}
    a = compose(smol, segs, seam_tokens=1, recompute_ratio=0.1, probe_cache=cache)
    b = compose(smol, segs, seam_tokens=1, recompute_ratio=0.2, probe_cache=cache)
    fresh = compose(smol, segs, seam_tokens=1, recompute_ratio=0.2)
    assert len(cache) == 1 and torch.equal(b.kv.data, fresh.kv.data) and a.computed_tokens < b.computed_tokens
    for bad in ("kv0", "kv99", "layer1", "", "attention"):
        with pytest.raises(ValueError):
            compose(smol, segs, recompute_ratio=0.1, probe=bad)


@pytest.mark.slow
def test_blending_a_lone_naively_spliced_chunk_never_writes_into_the_callers_chunk(smol):
    chunk = precompile_chunk(smol, smol.encode(A))
    before = chunk.data.clone()
    compose(smol, [ChunkSegment(chunk)], seam_tokens=1, rotate=False, recompute_ratio=0.5)
    assert torch.equal(chunk.data, before)


@pytest.mark.slow
def test_probe_forward_stops_at_the_layers_kv_and_gives_the_same_kv_as_prefill(engine):
    """The probe's early stop (right after layer N projects K/V) changes nothing in those K/V."""
    from kvruntime.ops.blend import _layer_kv
    kv = recompute(engine, engine.encode(A + B), logits=False).kv
    for layer in (1, 4):
        ref = engine.prefill(kv.token_ids[10:], kv.positions[10:], kv.slice(0, 10), stop_after_layer=layer).kv
        assert torch.equal(_layer_kv(engine, kv.token_ids[10:], kv.positions[10:], kv.slice(0, 10), layer),
                           ref.data[layer])
