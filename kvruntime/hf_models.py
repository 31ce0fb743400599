"""A user's Hugging Face checkpoint directory as a model: what is read from it, what is refused.

``model: /path/to/checkpoint`` (config.json, *.safetensors, a tokenizer with its chat template)
becomes a :class:`~kvruntime.models.ModelSpec` by :func:`spec_from_checkpoint`:

- architecture (:class:`ArchInfo`) from config.json: layers, GQA kv heads, head_dim, per-layer
  attention type and sliding window, RoPE per layer (:mod:`kvruntime.rope_config`), soft-capping;
- the context window: ``max_position_embeddings``, capped where the RoPE frequencies stop being
  static (dynamic NTK, longrope: see ``rope_config``);
- chat framing from the tokenizer's own chat template, rendered around a sentinel user message:
  the text before it opens a prompt (``chat_user_prefix``, after BOS when the template starts
  with the BOS token), the text after it closes the user turn and opens the assistant turn;
- the name used in requests, cache keys and block headers: ``<dir name>-<content hash>``, the
  hash covering config.json and the weights, so a changed checkpoint never reads old KV.

Architectures the reference engine cannot splice faithfully are refused with one line naming
what is missing (:class:`ModelRefused`); nothing is served approximately. Torch-free except
:func:`arch_info`'s RoPE derivation (transformers' own functions, no weights loaded).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

#: model_type -> family name shown in docs and logs: what the reference engine splices faithfully
SUPPORTED = {
    "llama": "Llama (2, 3, 3.1, 3.2, 3.3; SmolLM2)",
    "mistral": "Mistral (sliding window on every layer)",
    "qwen2": "Qwen2 / Qwen2.5 (qkv bias)",
    "qwen3": "Qwen3 (q/k norm)",
    "gemma2": "Gemma-2 (local/global layers, attention and final soft-capping)",
    "gemma3_text": "Gemma-3 text (local/global layers, per-layer RoPE base)",
    "phi3": "Phi-3 (fused qkv, longrope, partial rotary)",
}

#: model_type -> what the reference engine lacks for it (the one line of the refusal)
_REFUSED = {
    "gemma3": "Gemma-3 with a vision tower (Gemma3ForConditionalGeneration): give the text-only checkpoint",
    "bloom": "ALiBi position biases, no RoPE keys to re-rotate",
    "mpt": "ALiBi position biases, no RoPE keys to re-rotate",
    "falcon": "ALiBi / parallel-attention variants are not supported by the reference engine",
    "gpt2": "learned absolute position embeddings, no RoPE keys to re-rotate",
    "gpt_oss": "attention sinks (learned per-head sink logits) and MoE are not spliced by the reference engine",
    "deepseek_v2": "multi-head latent attention (MLA): the cache holds a compressed latent, not per-head keys",
    "deepseek_v3": "multi-head latent attention (MLA): the cache holds a compressed latent, not per-head keys",
    "mamba": "a state-space model has no KV cache to compose",
}

_SENTINEL = "\x00kvnotes-user-message\x00"
_WEIGHTS = ("*.safetensors",)


class ModelRefused(ValueError):
    """The checkpoint cannot be served faithfully; the message is one line naming what is missing."""


@dataclass(frozen=True)
class ArchInfo:
    """What the reference engine needs to know about an architecture, from its config."""
    model_type: str                    # config.model_type, e.g. "qwen3"
    num_layers: int
    kv_heads: int                      # GQA: key/value heads (<= attention heads)
    head_dim: int
    layer_types: tuple[str, ...]       # [layers] "full_attention" | "sliding_attention" as applied
    per_layer_masks: bool              # the model takes a mask per layer type (config.layer_types)
    sliding_window: int | None         # keys with q_pos - k_pos >= this are masked on sliding layers
    rope_types: tuple[str, ...]        # [layers] RoPE type of each layer
    context_window: int                # tokens (prompt + generated) accepted
    attn_softcap: float | None         # attention logit soft-capping (needs eager attention: SDPA drops it)
    checkpoint_dtype: str | None       # dtype the weights were saved in (config "dtype"/"torch_dtype")

    @property
    def attn_implementation(self) -> str:
        """``eager`` where SDPA would silently drop soft-capping (Gemma-2), else ``sdpa``."""
        return "eager" if self.attn_softcap else "sdpa"


def refusal(config) -> str | None:
    """The one-line reason ``config`` cannot be served faithfully, or None if it can."""
    mt = getattr(config, "model_type", None)
    if mt in _REFUSED:
        return f"model_type {mt!r}: {_REFUSED[mt]}"
    if mt not in SUPPORTED:
        return (f"model_type {mt!r} is not a family the reference engine splices faithfully "
                f"(supported: {', '.join(sorted(SUPPORTED))})")
    if getattr(config, "quantization_config", None):
        return "quantized checkpoint (quantization_config): give bfloat16/float16/float32 weights"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rope") not in ("rope", None):
        return "no rotary position embedding (ALiBi or absolute positions)"
    if getattr(config, "rope_parameters", None) is None:
        return f"model_type {mt!r} without rope_parameters: no RoPE to re-rotate"
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        return "mixture-of-experts layers are not supported by the reference engine"
    return None


def arch_info(config) -> ArchInfo:
    """:class:`ArchInfo` of a transformers config, or :class:`ModelRefused` with one line."""
    from kvruntime.rope_config import RopeConfigError, layer_types, rope_frequencies

    why = refusal(config)
    if why:
        raise ModelRefused(why)
    try:
        rope = rope_frequencies(config)
    except RopeConfigError as exc:
        raise ModelRefused(str(exc)) from None
    window = int(config.max_position_embeddings)
    if rope.static_up_to is not None:
        window = min(window, rope.static_up_to)
    types = tuple(layer_types(config))
    sliding = getattr(config, "sliding_window", None) if "sliding_attention" in types else None
    if "sliding_attention" in types and not sliding:
        raise ModelRefused("sliding-attention layers without a sliding_window size in config.json")
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return ArchInfo(config.model_type, int(config.num_hidden_layers),
                    int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
                    rope.head_dim, types, bool(getattr(config, "layer_types", None)),
                    int(sliding) if sliding else None, rope.rope_types, window,
                    getattr(config, "attn_logit_softcapping", None),
                    str(dtype).replace("torch.", "") if dtype is not None else None)


# ---- the checkpoint directory -------------------------------------------------------------

def is_checkpoint_dir(model: str) -> bool:
    """True if ``model`` names a directory holding a config.json (not a registry name)."""
    return os.path.isdir(os.path.expanduser(model)) and os.path.isfile(os.path.join(os.path.expanduser(model),
                                                                                    "config.json"))


def content_hash(path: Path) -> str:
    """SHA-256 (hex) over config.json and every ``*.safetensors`` file (name and bytes), in name
    order. Cost: one read of the weights (~1 GB/s), remembered per (file, size, mtime) under the
    kvnotes cache so a restart does not hash again."""
    from kvruntime.checkpoint import cache_root, sha256_file

    files = [path / "config.json"] + sorted(p for g in _WEIGHTS for p in path.glob(g))
    memo_dir = cache_root() / "hashes"
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        ident = hashlib.sha256(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
        memo = memo_dir / ident
        if memo.exists():
            digest = memo.read_text().strip()
        else:
            digest = sha256_file(f)
            try:
                memo_dir.mkdir(parents=True, exist_ok=True)
                memo.write_text(digest)
            except OSError:
                pass                      # a read-only cache only costs a re-hash next start
        h.update(f"{f.name}|{digest}\n".encode())
    return h.hexdigest()


def chat_framing(tokenizer) -> tuple[str, str, bool]:
    """``(user_prefix, user_suffix, prepend_bos)`` rendered from the tokenizer's chat template
    (one user turn, generation prompt added). No template: plain text (``""``, ``"\\nAnswer:"``,
    BOS if the tokenizer adds one), like the shipped base Gemma-3."""
    bos = tokenizer.bos_token
    if not getattr(tokenizer, "chat_template", None):
        adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        return "", "\nAnswer:", adds_bos
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                             add_generation_prompt=True, tokenize=False)
    except Exception as exc:          # a template that raises (jinja error, role rules) is unusable
        raise ModelRefused(f"the chat template cannot render one user message: {exc}".splitlines()[0]) from None
    pre, found, post = text.partition(_SENTINEL)
    if not found:
        raise ModelRefused("the chat template drops the user message")
    prepend = bool(bos) and pre.startswith(bos)
    return (pre[len(bos):] if prepend else pre), post, prepend


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:40] or "model"


def spec_from_checkpoint(model: str):
    """The :class:`~kvruntime.models.ModelSpec` of checkpoint directory ``model``, or
    :class:`ModelRefused` (one line). Reads config.json and the tokenizer; hashes the weights
    (see :func:`content_hash`); loads no weights."""
    import transformers

    from kvruntime.model_spec import ModelSpec

    path = Path(os.path.expanduser(model)).resolve()
    if not (path / "config.json").is_file():
        raise ModelRefused(f"{path} is not a checkpoint directory: no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelRefused(f"{path}/config.json cannot be read by transformers: {exc}".splitlines()[0]) from None
    arch = arch_info(config)
    if not any(next(path.glob(g), None) for g in _WEIGHTS):
        raise ModelRefused(f"{path} has no *.safetensors weights (pickled .bin weights are not loaded)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
    except (ValueError, OSError) as exc:
        raise ModelRefused(f"{path} has no usable tokenizer: {exc}".splitlines()[0]) from None
    prefix, suffix, bos = chat_framing(tok)
    digest = content_hash(path)
    return ModelSpec(name=f"{_slug(path.name)}-{digest[:16]}", family=arch.model_type, wheel="", gguf_name="",
                     context_window=arch.context_window, chat_user_prefix=prefix, chat_user_suffix=suffix,
                     prepend_bos=bos, checkpoint=str(path), content_hash=digest)


def describe(spec, arch: ArchInfo) -> str:
    """One log line: what was read from the checkpoint."""
    rope = ",".join(sorted(set(arch.rope_types)))
    local = sum(t == "sliding_attention" for t in arch.layer_types)
    return (f"model {spec.name}: {SUPPORTED.get(arch.model_type, arch.model_type)}; {arch.num_layers} layers "
            f"({local} sliding, window {arch.sliding_window}), {arch.kv_heads} kv heads x {arch.head_dim}, "
            f"RoPE {rope}, context {arch.context_window}, weights {arch.checkpoint_dtype}, "
            f"attention {arch.attn_implementation}")
