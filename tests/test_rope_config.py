"""kvruntime.rope_config derives, for every RoPE type transformers implements, exactly the
frequencies the model's own rotary module holds, and the bound below which they are static."""
from __future__ import annotations

import pytest
import torch

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(kind):
    import transformers as T
    rope = {"default": {"rope_type": "default", "rope_theta": 10000.0},
            "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
            "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 512}}
    if kind == "longrope":
        return T.Phi3Config(**{**SMALL, "num_key_value_heads": 4, "max_position_embeddings": 8192},
                            original_max_position_embeddings=2048,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0] * 8,
                                             "original_max_position_embeddings": 2048})
    return T.LlamaConfig(**SMALL, rope_parameters=rope[kind])


@pytest.mark.parametrize("kind,static_up_to,scaled", [
    ("default", None, False), ("linear", None, False), ("dynamic", 4096, False), ("yarn", None, True),
    ("llama3", None, False), ("longrope", 2048, True)])
def test_frequencies_equal_the_models_rotary_module(kind, static_up_to, scaled):
    import transformers as T
    from kvruntime.rope_config import model_inv_freq, rope_frequencies
    cfg = _config(kind)
    f = rope_frequencies(cfg)
    model = T.AutoModelForCausalLM.from_config(cfg)
    assert f.rope_types == (kind, kind) and f.static_up_to == static_up_to
    assert torch.equal(f.inv_freq, model_inv_freq(model))
    assert f.attention_scaling[0] == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert (f.attention_scaling[0] != 1.0) == scaled
    plain = rope_frequencies(_config("default")).inv_freq
    assert torch.equal(f.inv_freq, plain) == (kind in ("default", "dynamic"))  # dynamic: static below the bound


def test_per_layer_rope_of_gemma3_and_no_rope_refused():
    import transformers as T
    from kvruntime.rope_config import RopeConfigError, rope_frequencies
    g = T.Gemma3TextConfig(**SMALL, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    f = rope_frequencies(g)
    assert not torch.equal(f.inv_freq[0], f.inv_freq[1])        # local base 1e4, global 1e6
    with pytest.raises(RopeConfigError, match="no rope_parameters|no rotary"):
        rope_frequencies(T.GPT2Config(n_embd=64, n_layer=2, n_head=4))
