"""Tiny random-weight Hugging Face checkpoints of each supported family, for tests only.

Each is built with transformers' own config class (3 layers: the selective-recompute probe needs a layer after
its probe layer; hidden 64), saved with
``save_pretrained`` (safetensors) next to a small byte-level BPE tokenizer trained offline on a
few sentences, carrying a family-like chat template. Never a shipped model.
"""
from __future__ import annotations

from pathlib import Path

_TEXT = ["The quick brown fox jumps over the lazy dog while the committee reviews the quarterly budget in Lisbon.",
         "Dana bought headphones on March 3; the store accepts returns within 30 days with a receipt.",
         "The Varga Museum opens at nine and closes at six, except on Mondays when it is closed.",
         "Flight LX318 from Zurich to London is on time; boarding starts at gate B12.",
         "Answer the question using the notes above. What is the status? Correction: the price is now 12 euros."]
_SPECIALS = ["<pad>", "<s>", "</s>", "<bos>", "<eos>", "<|begin_of_text|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
             "[INST]", "[/INST]", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
VOCAB = 512

# family -> (bos, eos, chat template): the shape of each family's own template
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {
    "llama": ("<|begin_of_text|>", "<|eot_id|>",
              "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": (None, "<|im_end|>", "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a "
                                  "helpful assistant.<|im_end|>\n{% endif %}" + _CHATML),
    "qwen3": (None, "<|im_end|>", _CHATML),
    "mistral": ("<s>", "</s>", "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
                               "{{ m['content'] }}[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
                               "{% endfor %}"),
    "gemma": ("<bos>", "<eos>", "{{ bos_token }}{% for m in messages %}<start_of_turn>"
                                "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
                                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                                "{% endif %}"),
    "phi3": ("<s>", "<|end|>", "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}


_TRAINED: list = []


def _base_tokenizer():
    """A fresh copy of the BPE trained once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if _TRAINED:
        return Tokenizer.from_str(_TRAINED[0])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT * 4, trainer)
    _TRAINED.append(tok.to_str())
    return tok


def tokenizer(template: str):
    from transformers import PreTrainedTokenizerFast
    bos, eos, chat = TEMPLATES[template]
    return PreTrainedTokenizerFast(tokenizer_object=_base_tokenizer(), bos_token=bos, eos_token=eos,
                                   pad_token="<pad>", chat_template=chat)


def _ids(tok, bos, eos) -> dict:
    return dict(vocab_size=VOCAB, pad_token_id=tok.convert_tokens_to_ids("<pad>"),
                bos_token_id=tok.convert_tokens_to_ids(bos) if bos else None,
                eos_token_id=tok.convert_tokens_to_ids(eos))


def configs(tok_for) -> dict:
    """family -> (transformers config, template name). ``tok_for(template)``: its tokenizer."""
    import transformers as T
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1)

    def ids(t):
        return _ids(tok_for(t), *TEMPLATES[t][:2])
    return {
        "llama3": (T.LlamaConfig(**small, **ids("llama"), rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512}), "llama"),
        "qwen2": (T.Qwen2Config(**small, **ids("qwen2"), rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}),
            "qwen2"),
        "qwen3": (T.Qwen3Config(**small, **ids("qwen3"), head_dim=32), "qwen3"),
        "mistral": (T.MistralConfig(**small, **ids("mistral"), sliding_window=16), "mistral"),
        "gemma2": (T.Gemma2Config(**small, **ids("gemma"), head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]), "gemma"),
        "gemma3": (T.Gemma3TextConfig(**small, **ids("gemma"), head_dim=16, sliding_window=16,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
                   "gemma"),
        "phi3": (T.Phi3Config(**{**small, "num_key_value_heads": 4, "max_position_embeddings": 8192}, **ids("phi3"),
                              partial_rotary_factor=0.5, original_max_position_embeddings=4096,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0 + 0.1 * i for i in range(4)],
                                               "long_factor": [2.0 + 0.5 * i for i in range(4)],
                                               "original_max_position_embeddings": 4096}), "phi3"),
    }


def build_all(root: Path) -> dict[str, Path]:
    """Save every family's checkpoint under ``root``; family -> directory. Cost: ~2 s in all."""
    import torch
    import transformers as T

    toks = {t: tokenizer(t) for t in TEMPLATES}
    out = {}
    for fam, (cfg, template) in configs(toks.__getitem__).items():
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(cfg)
        d = root / f"tiny-{fam}"
        model.save_pretrained(d)
        toks[template].save_pretrained(d)
        out[fam] = d
    return out


def save_config_only(root: Path, name: str, config) -> Path:
    """A directory with only config.json (enough for a refusal, which comes before any weight)."""
    d = root / name
    config.save_pretrained(d)
    return d
