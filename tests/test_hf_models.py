"""Hugging Face checkpoint directories as models: each supported family (tiny random weights,
built with transformers' own config classes in tests/tiny_checkpoints.py) is read, framed by its
own chat template, re-rotated, composed and edited exactly; unsupported ones are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvruntime.ops.frame import chat_frame
from tests.conftest import tiny_engine

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
TEXT = "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly budget in Lisbon."
CHUNK_A = "Dana bought headphones on March 3; the store accepts returns within 30 days with a receipt.\n\n"
CHUNK_B = "The Varga Museum opens at nine and closes at six, except on Mondays when it is closed.\n\n"
QUESTION = "When does the Varga Museum close?"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---- what is read from the checkpoint ----------------------------------------------------------

#          rope type, sliding layers, window, head_dim, kv heads, attention, context
EXPECT = {"llama3": ("llama3", 0, None, 16, 2, "sdpa", 4096),
          "qwen2": ("yarn", 0, None, 16, 2, "sdpa", 4096),
          "qwen3": ("default", 0, None, 32, 2, "sdpa", 4096),
          "mistral": ("default", 3, 16, 16, 2, "sdpa", 4096),
          "gemma2": ("default", 2, 16, 16, 2, "eager", 4096),       # soft-capping: SDPA would drop it
          "gemma3": ("default", 2, 16, 16, 2, "sdpa", 4096),
          "phi3": ("longrope", 0, None, 16, 4, "sdpa", 4096)}        # 8192 capped at longrope's static 4096


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_and_architecture_are_read_from_the_checkpoint(tiny_checkpoints, family):
    e = tiny_engine(tiny_checkpoints, family)
    a = e.arch
    got = (a.rope_types[0], sum(t == "sliding_attention" for t in a.layer_types), a.sliding_window, a.head_dim,
           a.kv_heads, a.attn_implementation, e.context_window)
    assert got == EXPECT[family]
    assert e.spec.checkpoint == str(tiny_checkpoints[family].resolve())
    assert e.spec.name == f"tiny-{family}-{e.spec.content_hash[:16]}" and e.model_id == e.spec.name
    assert e.rope.enabled and e.rope.self_test_error < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_framing_is_the_tokenizers_own_template(tiny_checkpoints, family):
    e = tiny_engine(tiny_checkpoints, family)
    want = e.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=False)
    bos = e.tokenizer.bos_token if e.spec.prepend_bos else ""
    assert bos + e.spec.chat_user_prefix + QUESTION + e.spec.chat_user_suffix == want
    assert e.spec.chat_user_suffix and (family != "qwen2" or "You are a helpful assistant." in e.spec.chat_user_prefix)


def test_framing_of_two_families_spelled_out(tiny_checkpoints):
    llama, qwen3 = (tiny_engine(tiny_checkpoints, f).spec for f in ("llama3", "qwen3"))
    assert (llama.prepend_bos, llama.chat_user_prefix, llama.chat_user_suffix) == (
        True, "<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert (qwen3.prepend_bos, qwen3.chat_user_prefix, qwen3.chat_user_suffix) == (
        False, "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")


# ---- the KV operations are exact on every family -----------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("p,d", [(5, 1000), (40, 2900)])
def test_keys_rerotated_from_p_equal_keys_computed_at_p_plus_d(tiny_checkpoints, family, p, d):
    e = tiny_engine(tiny_checkpoints, family)
    ids = e.encode(TEXT)[:24]
    at_p = e.prefill(ids, torch.arange(p, p + len(ids))).kv
    at_pd = e.prefill(ids, torch.arange(p + d, p + d + len(ids))).kv
    assert _rel(e.rope.rotate(at_p.keys, d), at_pd.keys) < 1e-4
    assert _rel(at_p.keys, at_pd.keys) > 1e-2          # the test can fail: unrotated keys differ
    assert _rel(at_p.values, at_pd.values) < 1e-4       # attention sees relative positions only


@pytest.mark.parametrize("family", FAMILIES)
def test_composed_prefix_with_r1_equals_recompute(tiny_checkpoints, family):
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk, recompute
    e = tiny_engine(tiny_checkpoints, family)
    frame, a, b, q = chat_frame(e), e.encode(CHUNK_A), e.encode(CHUNK_B), e.encode(QUESTION + e.spec.chat_user_suffix)
    segs = [TextSegment(frame), ChunkSegment(precompile_chunk(e, a)), ChunkSegment(precompile_chunk(e, b)),
            TextSegment(q)]
    got = compose(e, segs, recompute_ratio=1.0)
    want = recompute(e, frame + a + b + q)
    assert torch.equal(got.kv.token_ids, want.kv.token_ids) and torch.equal(got.kv.positions, want.kv.positions)
    assert _rel(got.kv.data, want.kv.data) < 1e-4
    assert _rel(got.logits, want.logits) < 1e-4
    reused = compose(e, segs, recompute_ratio=0.0, seam_tokens=0)   # and the approximation is not the oracle
    assert _rel(reused.kv.data, want.kv.data) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_edit_in_place_with_every_token_recomputed_equals_recompute(tiny_checkpoints, family):
    from kvruntime.ops import edit_in_place, recompute
    e = tiny_engine(tiny_checkpoints, family)
    pre, old, post = chat_frame(e) + e.encode("Flight LX318 from Zurich to London is "), e.encode("on time"), \
        e.encode("; boarding starts at gate B12.\n\n" + QUESTION + e.spec.chat_user_suffix)
    new = e.encode("cancelled after a long delay")
    assert len(new) != len(old)                       # downstream slots are re-rotated first
    cached = recompute(e, pre + old + post).kv
    got = edit_in_place(e, cached, (len(pre), len(pre) + len(old)), new, top_k=len(post))
    want = recompute(e, pre + new + post).kv
    assert got.recomputed_tokens == len(new) + len(post)
    assert torch.equal(got.kv.positions, want.positions) and _rel(got.kv.data, want.data) < 1e-4


# ---- dtype ---------------------------------------------------------------------------------------

def test_bfloat16_end_to_end_engine_block_and_key(tiny_checkpoints):
    from kvruntime.messages.plan import KVRef
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk
    from kvtransport.transfer.blocks import decode_block, encode_block
    from kvtransport.tier.store import key_for
    e16, e32 = tiny_engine(tiny_checkpoints, "qwen3", "bfloat16"), tiny_engine(tiny_checkpoints, "qwen3")
    assert e16.model.dtype == torch.bfloat16 and e16.rope.enabled        # self-test passed in bf16
    frame, a, q = chat_frame(e16), e16.encode(CHUNK_A), e16.encode(QUESTION + e16.spec.chat_user_suffix)
    out = compose(e16, [TextSegment(frame), ChunkSegment(precompile_chunk(e16, a)), TextSegment(q)])
    assert out.kv.data.dtype == torch.bfloat16
    toks = e16.greedy(out.kv, out.logits, 3)
    assert len(toks) == 3
    block = encode_block("t1", e16.spec.name, out.kv)
    assert block.header.dtype == "bfloat16" and block.header.payload_bytes == out.kv.data.numel() * 2
    assert torch.equal(decode_block(block, model=e16.spec.name).data.view(torch.int16), out.kv.data.view(torch.int16))
    ref = KVRef(tuple(a), 0, "ab" * 16)
    k16, k32 = key_for(e16, ref), key_for(e32, ref)
    assert (k16.dtype, k32.dtype) == ("bfloat16", "float32") and k16 != k32 and k16.namespace != k32.namespace
    assert e16.spec.content_hash[:16] in k16.model_id


def test_content_hash_names_the_weights(tiny_checkpoints, tmp_path):
    from kvruntime.models import get_model_spec
    src = tiny_checkpoints["llama3"]
    copy = shutil.copytree(src, tmp_path / "tiny-llama3")
    assert get_model_spec(str(copy)).name == get_model_spec(str(src)).name      # same bytes, same name
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert get_model_spec(str(copy)).name != get_model_spec(str(src)).name


# ---- what is refused, in one line ----------------------------------------------------------------

def _refused_configs():
    import transformers as T
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
    return {
        "bloom": (T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=512), "ALiBi"),
        "gpt2": (T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512), "absolute position"),
        "gpt_oss": (T.GptOssConfig(**small, num_key_value_heads=2, head_dim=16), "attention sinks"),
        "deepseek_v3": (T.DeepseekV3Config(**small), "MLA"),
        "gemma3": (T.Gemma3Config(text_config=dict(**small, head_dim=16)), "vision tower"),
        "qwen2_moe": (T.Qwen2MoeConfig(**small), "not a family"),
    }


@pytest.mark.parametrize("name", ["bloom", "gpt2", "gpt_oss", "deepseek_v3", "gemma3", "qwen2_moe"])
def test_unsupported_architecture_is_refused_in_one_line(tmp_path, name):
    from kvruntime.hf_models import ModelRefused
    from kvruntime.models import get_model_spec
    from tests.tiny_checkpoints import save_config_only
    cfg, phrase = _refused_configs()[name]
    d = save_config_only(tmp_path, name, cfg)
    with pytest.raises(ModelRefused) as exc:
        get_model_spec(str(d))
    msg = str(exc.value)
    assert "\n" not in msg and phrase in msg, msg


def test_unusable_checkpoints_are_refused_in_one_line(tiny_checkpoints, tmp_path):
    from kvruntime.hf_models import ModelRefused
    from kvruntime.models import get_model_spec
    d = shutil.copytree(tiny_checkpoints["qwen3"], tmp_path / "q")
    cases = []
    for f in d.glob("*.safetensors"):
        f.unlink()
    cases.append((d, "no *.safetensors"))
    e = shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "r")
    cfg = json.loads((e / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "made-up", "rope_theta": 10000.0}
    (e / "config.json").write_text(json.dumps(cfg))
    cases.append((e, "made-up"))
    f = shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "s")
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (f / "config.json").write_text(json.dumps(cfg))
    cases.append((f, "quantized"))
    for path, phrase in cases:
        with pytest.raises(ModelRefused) as exc:
            get_model_spec(str(path))
        assert "\n" not in str(exc.value) and phrase in str(exc.value), str(exc.value)


def test_config_takes_a_checkpoint_directory_and_three_dtypes(tiny_checkpoints):
    from kvruntime.config import ClusterConfig
    for dtype in ("float32", "bfloat16", "float16"):
        assert ClusterConfig.of(model=str(tiny_checkpoints["qwen3"]), dtype=dtype).workers.dtype == dtype
    for bad in (dict(model="/no/such/dir"), dict(model="gpt-7"), dict(dtype="float64"), dict(dtype="fp8")):
        with pytest.raises(ValueError):
            ClusterConfig.of(**bad)
