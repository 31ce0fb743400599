"""The RoPE self-test checks the rotation, not the forward's rounding: a correct rotation passes on a
deep bf16 model whose 32 layers drift past the old bound (the old multi-token comparison is measured
here beside it), and wrong rotations (base, sign, half layout, 1% frequency, one layer type's base)
are still caught in fp32 and bf16. Random weights, built with transformers' config classes: tests only."""
from __future__ import annotations

import pytest
import torch

from kvruntime.rope import RopeTable, self_test, self_test_tolerance
from tests.conftest import tiny_engine

OLD_TOLERANCE_16BIT = 3e-2      # the bound the old 24-token comparison used for 16-bit dtypes


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A 32-layer Llama-3.1-shaped checkpoint (llama3 RoPE, base 5e5, head_dim 128, GQA), tiny hidden size."""
    import transformers as T
    from tests.tiny_checkpoints import TEMPLATES, _ids, tokenizer
    tok = tokenizer("llama")
    cfg = T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=32, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=128, max_position_embeddings=131072, initializer_range=0.1,
                        **_ids(tok, *TEMPLATES["llama"][:2]),
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("deep") / "deep-llama-32"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _engine(path, dtype):
    from kvruntime.engine import ReferenceEngine
    return ReferenceEngine(str(path), dtype=dtype, threads=1, run_self_test=False)


def _old_style_error(e, source=7, target=3001, tokens=24) -> float:
    """What the old self-test measured: one 24-token forward at each position, all layers' keys."""
    ids = e.encode("The quick brown fox jumps over the lazy dog while the committee reviews "
                   "the quarterly budget in Lisbon.")[:tokens]
    a = e.prefill(ids, torch.arange(source, source + len(ids))).kv.keys.float()
    b = e.prefill(ids, torch.arange(target, target + len(ids))).kv.keys.float()
    e.rope.enabled = True
    rotated = e.rope.rotate(a, target - source)
    return float((rotated - b).norm() / b.norm())


class _Interleaved(RopeTable):
    """The wrong half convention: rotates (2j, 2j+1) pairs (GPT-J layout) instead of (j, j + half)."""

    def rotate(self, keys, delta, out=None):
        d = keys.shape[-1]
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        inv = torch.argsort(perm)
        return super().rotate(keys[..., perm].contiguous(), delta)[..., inv]


def _wrong_tables(good: RopeTable) -> dict[str, RopeTable]:
    half = good.inv_freq.shape[1]
    base_1e4 = (1.0 / 1e4 ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half))).repeat(good.inv_freq.shape[0], 1)
    return {"base 1e4": RopeTable(base_1e4, good.head_dim),
            "sign": RopeTable(-good.inv_freq, good.head_dim),
            "1% frequency": RopeTable(good.inv_freq * 1.01, good.head_dim),
            "half layout": _Interleaved(good.inv_freq.clone(), good.head_dim)}


def test_tolerance_per_dtype():
    assert self_test_tolerance(torch.float32, 3007) == pytest.approx(4 * 1.19e-7 + 3007 * 1.19e-7, rel=1e-2)
    assert 3e-4 < self_test_tolerance(torch.float32, 3007) < 4e-4
    assert 3.1e-2 < self_test_tolerance(torch.bfloat16, 3007) < 3.2e-2
    assert 4e-3 < self_test_tolerance(torch.float16, 3007) < 4.5e-3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_correct_rotation_passes_on_a_deep_model_where_the_old_test_failed(deep_llama, dtype, one_torch_thread):
    e = _engine(deep_llama, dtype)
    old = _old_style_error(e)
    assert self_test(e, e.rope) is True, e.rope.self_test_error
    new = e.rope.self_test_error
    print(f"{dtype}: old 24-token comparison {old:.2e}, one-token per-layer self-test {new:.2e}")
    if dtype == "bfloat16":     # measured: old 4.9e-2 (would have disabled reposition), new 3.2e-3
        assert old >= OLD_TOLERANCE_16BIT and new < OLD_TOLERANCE_16BIT / 5
    else:                       # measured: old 1.1e-4 (over the old fp32 bound 1e-4), new 1.7e-5
        assert old > 1e-4 > new
    assert new < self_test_tolerance(e.dtype, 3001 + 6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wrong_rotations_are_still_caught(deep_llama, dtype, one_torch_thread):
    e = _engine(deep_llama, dtype)
    for name, table in _wrong_tables(e.rope).items():
        assert self_test(e, table) is False, name
        assert table.enabled is False and table.self_test_error > 0.1, (name, table.self_test_error)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_each_layer_types_base_is_checked(tiny_checkpoints, dtype):
    """Gemma-3 rotates sliding layers with base 1e4 and global ones with 1e6: a table that uses the
    sliding base everywhere is wrong on one layer in three, and the per-layer test catches it."""
    e = tiny_engine(tiny_checkpoints, "gemma3", dtype)
    inv = e.rope.inv_freq
    assert not torch.equal(inv[0], inv[2])                          # two bases
    assert self_test(e, e.rope) is True
    one_base = RopeTable(inv[0].repeat(inv.shape[0], 1), e.rope.head_dim)
    assert self_test(e, one_base) is False and one_base.self_test_error > 0.1
    assert self_test(e, e.rope) is True                             # the real table passes again


def test_self_test_checks_only_the_rotation_one_token_at_a_time():
    """The forwards it runs: one token each, at source + i and target + i (no attention between
    tokens, so the hidden states do not depend on the position)."""
    calls = []

    class _Fake:
        dtype = torch.float32

        def encode(self, text):
            return [5, 6, 7, 8, 9, 10, 11]

        def prefill(self, ids, positions):
            calls.append((list(ids), list(positions)))
            k = torch.ones(2, 1, len(ids), 8) * ids[0]
            table = RopeTable(torch.ones(2, 4, dtype=torch.float64) * 0.5, 8)
            table.enabled = True
            keys = table.rotate(k, positions[0])

            class _Out:
                class kv:
                    pass
            _Out.kv.keys = keys
            return _Out

    good = RopeTable(torch.ones(2, 4, dtype=torch.float64) * 0.5, 8)
    assert self_test(_Fake(), good, source=3, target=40, tokens=3) is True
    assert calls == [([5], [3]), ([6], [4]), ([7], [5]), ([5], [40]), ([6], [41]), ([7], [42])]
    assert good.self_test_error < 1e-6
    bad = RopeTable(torch.ones(2, 4, dtype=torch.float64) * 0.6, 8)
    assert self_test(_Fake(), bad, source=3, target=40, tokens=3) is False
