"""KV operations on the real models, against full recompute."""
import pytest
import torch

from kvruntime.errata import erratum_text
from kvruntime.fidelity.metrics import kl_divergence
from kvruntime.ops import (ChunkSegment, TextSegment, compose, edit_in_place, erratum, precompile_chunk,
                           recompute, seam_repair)

DOC = ("Order 5512 for Lena Moreau. Delivery status: {status}. The parcel holds two ceramic vases "
       "and a linen tablecloth. Customers whose parcel is lost are refunded in full within a week; "
       "delivered parcels can be returned within 30 days.\n")


def _finish(engine, kv, q):
    start = int(kv.positions.max()) + 1
    return engine.prefill(q, torch.arange(start, start + len(q)), kv, logits=True).logits


@pytest.mark.slow
def test_compose_places_chunks_contiguously_and_counts_tokens(smol):
    a, b = smol.encode("Alpha facts here.\n\n"), smol.encode("Beta facts follow.\n\n")
    pre, q = smol.encode("Context:\n"), smol.encode("Question?")
    res = compose(smol, [TextSegment(pre), ChunkSegment(precompile_chunk(smol, a)),
                         ChunkSegment(precompile_chunk(smol, b)), TextSegment(q)], seam_tokens=1)
    n = len(pre) + len(a) + len(b) + len(q)
    assert res.kv.positions.tolist() == list(range(n))
    assert res.kv.token_ids.tolist() == pre + a + b + q
    assert res.chunk_starts == [len(pre), len(pre) + len(a)]
    assert res.computed_tokens == len(pre) + 2 + len(q) and res.reused_tokens == len(a) + len(b) - 2


@pytest.mark.slow
def test_seam_repair_of_every_token_is_recompute(smol):
    """Repairing a whole chunk (k = its length) must give exactly the recomputed KV."""
    pre, c = smol.encode("Notes:\n"), smol.encode("The museum closes at six on Sundays.\n")
    full = recompute(smol, pre + c, logits=False).kv
    comp = compose(smol, [TextSegment(pre), ChunkSegment(precompile_chunk(smol, c))], seam_tokens=0)
    repaired = seam_repair(smol, comp.kv, [len(pre)], k=len(c))
    assert torch.allclose(repaired.data, full.data, atol=1e-4)
    assert not torch.allclose(comp.kv.data, full.data, atol=1e-3)   # before repair it differs


@pytest.mark.slow
def test_batched_seam_repair_equals_chunk_by_chunk(smol):
    """One forward over every seam == repairing the chunks one after another, left to right."""
    pre = smol.encode("Notes:\n")
    chunks = [smol.encode(t) for t in ("The bakery opens at seven.\n", "Its rye bread costs four euros.\n",
                                       "On Sundays it closes at noon.\n")]
    comp = compose(smol, [TextSegment(pre)] + [ChunkSegment(precompile_chunk(smol, c)) for c in chunks], seam_tokens=0)
    batched = seam_repair(smol, comp.kv, comp.chunk_starts, k=3)
    one_by_one = comp.kv
    for s in comp.chunk_starts:
        one_by_one = seam_repair(smol, one_by_one, [s], k=3)
    assert torch.allclose(batched.data, one_by_one.data, atol=1e-4)
    assert not torch.allclose(batched.data, comp.kv.data, atol=1e-3)


@pytest.mark.slow
def test_rotated_plus_seam_beats_naive_splice_on_shipped_cases(engine):
    """Mean KL vs recompute over shipped compose cases: reposition + seam 1 < naive splice."""
    from kvruntime.fidelity.cases import load_compose_cases, load_passages
    from kvruntime.fidelity.runner import COMPOSE_OPS, run_compose

    cases = load_compose_cases()[:6]
    compared = ("reposition + seam 1", "naive splice (no re-rotation)")     # the two ops the claim is about
    rows = run_compose(engine, cases, load_passages(), greedy_n=1, progress=lambda _: None,
                       ops={op: COMPOSE_OPS[op] for op in compared})
    kl = {op: sum(r["kl"] for r in rows[op]) / len(rows[op]) for op in compared}
    assert kl["reposition + seam 1"] < kl["naive splice (no re-rotation)"], kl


@pytest.mark.slow
def test_edit_in_place_recomputing_all_downstream_equals_recompute(smol):
    pre = smol.encode("Record:\n")
    before, after = DOC.split("{status}")
    b, a = pre + smol.encode(before), smol.encode(after)
    old, new = smol.encode("IN TRANSIT"), smol.encode("LOST")      # different lengths: shift
    assert len(old) != len(new)
    cached = recompute(smol, b + old + a, logits=False).kv
    oracle = recompute(smol, b + new + a, logits=False).kv
    res = edit_in_place(smol, cached, (len(b), len(b) + len(old)), new, top_k=len(a))
    assert res.kv.positions.tolist() == list(range(len(b) + len(new) + len(a)))
    assert res.kv.token_ids.tolist() == b + new + a
    assert torch.allclose(res.kv.data, oracle.data, atol=2e-4)
    assert res.recomputed_tokens == len(new) + len(a)


@pytest.mark.slow
def test_edit_in_place_topk_improves_on_field_only(smol):
    pre = smol.encode("Record:\n")
    before, after = DOC.split("{status}")
    b, a = pre + smol.encode(before), smol.encode(after)
    old, new = smol.encode("DELIVERED"), smol.encode("LOST")
    q = smol.encode("What is the delivery status? Answer in one word.")
    cached = recompute(smol, b + old + a, logits=False).kv
    oracle = recompute(smol, b + new + a + q).logits
    span = (len(b), len(b) + len(old))
    field_only = edit_in_place(smol, cached, span, new, top_k=0)
    top = edit_in_place(smol, cached, span, new, top_k=len(a) // 2)
    assert len(top.selected_slots) == len(a) // 2 and field_only.selected_slots == []
    kl_f = kl_divergence(oracle, _finish(smol, field_only.kv, q))
    kl_t = kl_divergence(oracle, _finish(smol, top.kv, q))
    assert kl_t < kl_f, (kl_t, kl_f)


@pytest.mark.slow
def test_erratum_reuses_old_context_whole(smol):
    ids = smol.encode(DOC.format(status="DELIVERED"))
    cached = recompute(smol, ids, logits=False).kv
    res = erratum(smol, cached, "delivery status", "DELIVERED", "LOST")
    assert torch.equal(res.kv.data[:, :, :, : cached.num_tokens], cached.data)   # bytes untouched
    assert res.kv.positions.tolist() == list(range(len(ids) + len(res.token_ids)))
    assert "LOST" in res.text and "DELIVERED" not in res.text                  # default: no restating


def test_erratum_text_validates():
    assert erratum_text("gate", "B12") == "\nCorrection: the gate is now B12.\n"
    assert "not A3" in erratum_text("gate", "B12", old="A3", style="restate_old")
    with pytest.raises(ValueError):
        erratum_text("gate", "B12", style="shout")
    with pytest.raises(ValueError):
        erratum_text("gate", "B12", style="restate_old")
    with pytest.raises(ValueError):
        erratum_text(" ", "B12")


@pytest.mark.slow
def test_edit_in_place_bad_input(smol):
    kv = recompute(smol, smol.encode("Some cached text here."), logits=False).kv
    with pytest.raises(ValueError):
        edit_in_place(smol, kv, (3, 99), smol.encode("x"), 1)
    with pytest.raises(ValueError):
        edit_in_place(smol, kv, (1, 2), [], 1)
    with pytest.raises(ValueError):
        edit_in_place(smol, kv, (1, 2), smol.encode("x"), -1)
