"""The edit-in-place probe (and blend's kv probe) run in query chunks give what one shot gives."""
import pytest
import torch

from kvruntime.ops import edit_in_place, recompute
from kvruntime.ops.blend import _probe_all, probe_kv

RECORD = ("Customer record. Account owner: Maria Lopez. Plan: gold. Region: north-east. "
          "Notes follow about deliveries, invoices and support tickets over the last year.\n")
FILLER = ("On {d} the courier delivered order {n} to the warehouse; the invoice of {m} dollars was "
          "paid by the account owner and the support ticket about the late parcel was closed.\n")


def _context(engine, tokens: int = 600):
    text, i = RECORD, 0
    while len(engine.encode(text)) < tokens:
        text += FILLER.format(d=f"day {i}", n=1000 + 7 * i, m=40 + 3 * i)
        i += 1
    ids = engine.encode(text)[:tokens]
    head = engine.encode("Customer record. Account owner:")
    field = engine.encode(" Maria Lopez")
    assert ids[:len(head) + len(field)] == head + field      # the field sits near the start
    return recompute(engine, ids, logits=False).kv, (len(head), len(head) + len(field))


@pytest.mark.slow
def test_chunked_probe_equals_the_one_shot_probe(smol):
    kv, (a, b) = _context(smol)
    tail = kv.slice(b)
    for layer in (1, 3):
        ref = smol.prefill(tail.token_ids, tail.positions, kv.slice(0, b), stop_after_layer=layer).kv.data[layer]
        one = probe_kv(smol, tail.token_ids, tail.positions, kv.slice(0, b), layer, chunk=10 ** 6)
        assert torch.equal(one, ref)                                   # one chunk: bit-identical
        got = probe_kv(smol, tail.token_ids, tail.positions, kv.slice(0, b), layer, chunk=128)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), float((got - ref).abs().max())
    with pytest.raises(ValueError, match="chunk"):
        probe_kv(smol, tail.token_ids, tail.positions, kv.slice(0, b), 1, chunk=0)


@pytest.mark.slow
def test_chunked_edit_in_place_picks_the_same_slots_and_kv(smol):
    kv, span = _context(smol)
    new = smol.encode(" Jonathan Brightwater-Smith")               # a longer value: downstream re-rotated
    one = edit_in_place(smol, kv, span, new, 16, probe_chunk=10 ** 6)
    got = edit_in_place(smol, kv, span, new, 16, probe_chunk=128)
    assert got.probed_tokens == one.probed_tokens == kv.num_tokens - span[1] > 3 * 128
    assert len(got.selected_slots) == 16
    assert got.selected_slots == one.selected_slots
    assert torch.equal(got.kv.positions, one.kv.positions) and torch.equal(got.kv.token_ids, one.kv.token_ids)
    assert torch.allclose(got.kv.data, one.kv.data, atol=1e-5, rtol=0), float((got.kv.data - one.kv.data).abs().max())
    # the selected slots changed; every other downstream slot kept its cached values (only keys re-rotated)
    a, b = span
    start = a + len(new)
    rest = [j for j in range(start, kv.num_tokens + len(new) - (b - a)) if j not in set(got.selected_slots)]
    old_idx = torch.tensor(rest) - (len(new) - (b - a))
    assert torch.equal(got.kv.data[:, 1][:, :, rest], kv.data[:, 1][:, :, old_idx])
    sel = torch.tensor(got.selected_slots)
    assert not torch.allclose(got.kv.data[:, 1][:, :, sel], kv.data[:, 1][:, :, sel - (len(new) - (b - a))])


@pytest.mark.slow
def test_blend_probe_is_chunked_the_same_way(smol, monkeypatch):
    import kvruntime.ops.blend as blend
    kv, (a, b) = _context(smol)
    new = smol.encode(" Jonathan Brightwater-Smith")
    stale = edit_in_place(smol, kv, (a, b), new, 0).kv        # new field, downstream not recomputed
    start = a + len(new)
    one = _probe_all(smol, stale, start, 1)
    monkeypatch.setattr(blend, "PROBE_CHUNK", 100)
    got = _probe_all(smol, stale, start, 1)
    assert float(one.max()) > 1e-3                                   # the probe sees the edit
    assert torch.equal(torch.topk(got, 32).indices.sort().values, torch.topk(one, 32).indices.sort().values)
    assert torch.allclose(got, one, rtol=1e-4, atol=1e-5)
