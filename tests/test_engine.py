"""Reference engine on the real models: exact prefix reuse, masks, decoding, bad input."""
import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.ops import recompute

TEXT = ("The harbour office in Tromso opens at 07:30 on weekdays. Ferries to Skjervoy leave at "
        "08:15 and 16:40; tickets cost 210 kroner for adults and half price for children. ")


@pytest.mark.slow
def test_exact_prefix_reuse_equals_recompute(engine):
    ids = engine.encode(TEXT * 2)
    full = recompute(engine, ids)
    head = engine.prefill(ids[:17], torch.arange(17))                       # cached earlier
    tail = engine.prefill(ids[17:], torch.arange(17, len(ids)), head.kv, logits=True)
    assert torch.allclose(full.logits, tail.logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(KVCache.cat([head.kv, tail.kv]).data, full.kv.data, atol=1e-4)


@pytest.mark.slow
def test_explicit_position_mask_matches_hf_own_mask_past_sliding_window(gemma):
    """Our per-layer-type masks == transformers' own causal/sliding masks (>512 tokens)."""
    ids = [gemma.bos_id] + gemma.encode(TEXT * 14)
    assert len(ids) > gemma.sliding_window + 50
    ours = recompute(gemma, ids).logits
    with torch.inference_mode():
        hf = gemma.model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, hf, atol=1e-3)


@pytest.mark.slow
def test_generate_greedy_matches_hf_generate(smol):
    ids = smol.encode(smol.spec.chat_user_prefix + "Name three colours." + smol.spec.chat_user_suffix)
    out = recompute(smol, ids)
    ours = smol.greedy(out.kv, out.logits, 10)
    with torch.inference_mode():
        hf = smol.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == hf


@pytest.mark.slow
def test_sampling_is_seeded(smol):
    ids = smol.encode("Once upon a time")
    out = recompute(smol, ids)
    a = list(smol.generate(out.kv, out.logits, 8, temperature=0.9, top_p=0.9, seed=3))
    b = list(smol.generate(out.kv, out.logits, 8, temperature=0.9, top_p=0.9, seed=3))
    assert a == b


@pytest.mark.slow
def test_bad_input_is_a_value_error(smol):
    with pytest.raises(ValueError):
        smol.prefill([], [])
    with pytest.raises(ValueError):
        smol.prefill([1, 2], [0])
    with pytest.raises(ValueError):
        smol.prefill([1], [-1])
    with pytest.raises(ValueError):
        list(smol.generate(smol.empty_kv(), torch.zeros(10), 2, temperature=-1))


def test_unknown_model_and_dtype_are_clear_errors():
    from kvruntime.engine import ReferenceEngine
    from kvruntime.models import get_model_spec

    with pytest.raises(ValueError, match="known models"):
        get_model_spec("gpt-7")
    with pytest.raises(ValueError, match="dtype"):
        ReferenceEngine("smollm2-135m", dtype="int3")


def test_kvcache_validates_shapes():
    with pytest.raises(ValueError):
        KVCache(torch.zeros(2, 3, 1, 4, 8), torch.arange(4), torch.arange(4))
    with pytest.raises(ValueError):
        KVCache(torch.zeros(2, 2, 1, 4, 8), torch.arange(3), torch.arange(4))
    kv = KVCache(torch.randn(2, 2, 1, 4, 8), torch.tensor([3, 1, 2, 0]), torch.arange(4))
    s = kv.sorted_by_position()
    assert s.positions.tolist() == [0, 1, 2, 3] and s.is_position_ordered()
    assert torch.equal(s.data[:, :, :, 0], kv.data[:, :, :, 3])
