"""RoPE frequencies of a checkpoint, derived from its config by transformers' own functions.

:func:`rope_frequencies` returns, per decoder layer, the inverse frequencies and the attention
scaling the model's rotary module uses, for every RoPE type transformers implements (default,
linear, dynamic, yarn, longrope, llama3, proportional). It calls the same code the model's
rotary module calls (``ROPE_INIT_FUNCTIONS[rope_type]``, or the model class's own
``compute_default_rope_parameters`` for "default", which knows e.g. Phi-3's partial rotary), so it
cannot drift from the weights' forward pass; the reference engine also checks it against the
loaded module at start.

What re-rotation needs from it:
- ``inv_freq`` [layers, rotary_dim // 2]: a key moves from position p to q by one more rotation
  of ``(q - p) * inv_freq`` on its (j, j + rotary_dim / 2) pairs (HF rotate_half layout).
- ``attention_scaling`` (yarn / longrope mscale) multiplies cos and sin, i.e. every cached key,
  by a position-independent constant: a rotation commutes with it, so re-rotation ignores it.
- ``static_up_to``: dynamic NTK recomputes its frequencies once a forward reaches beyond
  ``max_position_embeddings`` and longrope switches from short to long factors beyond
  ``original_max_position_embeddings``; below that bound the frequencies are constant, above it
  keys cached earlier would be rotated with other frequencies than new ones. The model spec caps
  the context window there (``None``: static at every position).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

#: RoPE types whose frequencies do not depend on the sequence length
STATIC_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
#: RoPE types whose frequencies change with the sequence length (served below ``static_up_to``)
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


class RopeConfigError(ValueError):
    """The checkpoint's RoPE cannot be derived (unknown type, no rotary module, bad parameters)."""


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor                  # [layers, rotary_dim // 2] float64 (the fp32 values the model uses)
    attention_scaling: tuple[float, ...]    # [layers] cos/sin multiplier (1.0 unless yarn / longrope)
    rope_types: tuple[str, ...]             # [layers] rope_type of each layer's parameters
    head_dim: int                           # key head dim; dims >= rotary_dim are not rotated
    static_up_to: int | None                # positions < this have static frequencies; None: all

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[1]


def layer_types(config) -> list[str]:
    """Per-layer attention type ("full_attention" | "sliding_attention") as the model applies it:
    ``config.layer_types`` where the config has them; else every layer is sliding when the config
    sets ``sliding_window`` (Mistral, Phi-3 apply it to all layers), full otherwise."""
    n = config.num_hidden_layers
    lt = getattr(config, "layer_types", None)
    if lt:
        return list(lt)
    return ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n


def _per_layer_params(config) -> bool:
    """True when ``config.rope_parameters`` is a mapping layer type -> parameters (Gemma-3)."""
    rp = getattr(config, "rope_parameters", None)
    return isinstance(rp, dict) and bool(rp) and all(isinstance(v, dict) for v in rp.values())


def _default_fn(config):
    """The model class's own ``compute_default_rope_parameters`` (its rotary embedding class)."""
    mt = config.model_type
    for name in (mt, mt.rsplit("_", 1)[0]):          # gemma3_text -> gemma3
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        for attr in dir(mod):
            cls = getattr(mod, attr)
            if attr.endswith("RotaryEmbedding") and hasattr(cls, "compute_default_rope_parameters"):
                return cls.compute_default_rope_parameters
    raise RopeConfigError(f"model_type {mt!r} has no rotary embedding in transformers (no RoPE)")


def rope_frequencies(config) -> RopeFrequencies:
    """Per-layer RoPE inverse frequencies and attention scaling of ``config`` (a transformers
    ``PreTrainedConfig``), computed on the CPU by transformers' own init functions with
    ``seq_len=None`` (the frequencies the model starts with). Cost: microseconds, no weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if getattr(config, "rope_parameters", None) is None:
        raise RopeConfigError(f"model_type {config.model_type!r} has no rope_parameters (no RoPE)")
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    per_layer = _per_layer_params(config)
    types = layer_types(config)
    rows, scales, kinds, cache = [], [], [], {}
    static_up_to: int | None = None
    for lt in types:
        if lt not in cache:
            params = config.rope_parameters[lt] if per_layer else config.rope_parameters
            kind = params.get("rope_type", params.get("type", "default"))
            if kind == "default":
                fn = _default_fn(config)
            elif kind in ROPE_INIT_FUNCTIONS:
                fn = ROPE_INIT_FUNCTIONS[kind]
            else:
                raise RopeConfigError(f"rope_type {kind!r} is not implemented by transformers "
                                      f"(known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
            kw = {"layer_type": lt} if per_layer else {}
            try:
                inv, scale = fn(config, device=torch.device("cpu"), **kw)
            except (KeyError, TypeError, ValueError) as exc:
                raise RopeConfigError(f"rope_parameters of type {kind!r} are incomplete: {exc}") from None
            if kind == "dynamic":
                bound = int(config.max_position_embeddings)
            elif kind == "longrope":
                bound = int(params.get("original_max_position_embeddings")
                            or getattr(config, "original_max_position_embeddings"))
            else:
                bound = None
            cache[lt] = (inv.detach().to("cpu", torch.float64), float(scale), kind, bound)
        inv, scale, kind, bound = cache[lt]
        rows.append(inv)
        scales.append(scale)
        kinds.append(kind)
        if bound is not None:
            static_up_to = bound if static_up_to is None else min(static_up_to, bound)
    if len({r.shape for r in rows}) != 1:
        raise RopeConfigError("layers rotate different numbers of dims (per-layer partial rotary)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return RopeFrequencies(torch.stack(rows), tuple(scales), tuple(kinds), int(head_dim), static_up_to)


def model_inv_freq(model) -> torch.Tensor:
    """[layers, rotary_dim // 2] float64: the inverse frequencies a loaded HF model's rotary
    module holds (the same read as ``RopeTable.from_model``), to check :func:`rope_frequencies`."""
    cfg = model.config
    rot = model.model.rotary_emb
    rows = []
    for lt in layer_types(cfg) if getattr(cfg, "layer_types", None) else [None] * cfg.num_hidden_layers:
        freq = getattr(rot, f"{lt}_inv_freq", None) if lt else None
        rows.append((rot.inv_freq if freq is None else freq).detach().to("cpu", torch.float64))
    return torch.stack(rows)
