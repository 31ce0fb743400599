"""A checkpoint's tokenizer without importing torch: the class ``AutoTokenizer`` would pick, loaded directly.

The router renders prompts and counts tokens; it never runs a model. ``transformers.AutoTokenizer``
imports torch on the way (``tokenization_auto`` -> ``configuration_utils`` -> ``generation`` ->
torch: seconds of CPU and hundreds of MB on every router replica start), although the tokenizer
classes themselves (``TokenizersBackend``, ``GemmaTokenizer``, ``Qwen2Tokenizer`` ...) do not.

:func:`load_tokenizer` reads ``tokenizer_config.json`` and ``config.json`` as JSON and follows
``AutoTokenizer.from_pretrained``'s own decision (transformers 5, ``models/auto/tokenization_auto``)
for a local checkpoint directory, then calls the chosen class's ``from_pretrained``: same class,
same files, same special tokens and chat template. The decision needs two of transformers'
tables (the tokenizer class registered per ``model_type``; the model types whose Hub
``tokenizer_class`` is overridden); they are snapshotted below for the families the project
serves (``kvruntime.hf_models.SUPPORTED``) and tests/test_tokenizer_load.py checks the snapshot
against the installed transformers and the loaded tokenizers against ``AutoTokenizer``.

Whatever this does not decide with certainty (a model type outside the snapshot, a remote-code
``auto_map``, a tokenizer class transformers does not export, a Mistral ``tekken.json``, no
``tokenizer_class`` ...) goes to ``AutoTokenizer`` itself: correct, only slower (it imports torch),
with a warning naming the reason, counted in :data:`FALLBACKS`. Failing instead would refuse
checkpoints that serve correctly today; guessing would risk a different tokenizer, i.e. different
token ids from the workers' (which load with ``AutoTokenizer``).
"""
from __future__ import annotations

import collections
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: reason -> how many loads went to ``AutoTokenizer`` (and imported torch) in this process
FALLBACKS: collections.Counter = collections.Counter()

_MISTRAL = object()   # transformers registers MistralCommonBackend when mistral-common is installed, else TokenizersBackend

#: model_type -> transformers' ``TOKENIZER_MAPPING_NAMES[model_type]`` (None: not in the table);
#: a snapshot for the served families, checked against the installed transformers by the tests
REGISTERED = {
    "llama": None,
    "mistral": _MISTRAL,
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "phi3": "TokenizersBackend",
}
#: the model types above in transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``: their
#: registered class wins over the checkpoint's ``tokenizer_class`` (same check as REGISTERED)
HUB_CLASS_OVERRIDDEN = frozenset({"qwen2", "phi3"})

_GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")


class Unresolved(Exception):
    """This module cannot decide the class with certainty; the message says why."""


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer ``transformers.AutoTokenizer.from_pretrained(path)`` gives, for a local
    checkpoint directory, without importing torch where the class is decided here (see the
    module docstring; otherwise ``AutoTokenizer`` itself, logged and counted in :data:`FALLBACKS`)."""
    try:
        cls = tokenizer_class(path)
    except Unresolved as why:
        reason = str(why)
        FALLBACKS[reason] += 1
        log.warning("tokenizer of %s: loading with transformers.AutoTokenizer (imports torch): %s", path, reason)
        import transformers
        return transformers.AutoTokenizer.from_pretrained(path)
    return cls.from_pretrained(path)


def tokenizer_class(path: str | os.PathLike) -> type:
    """The class ``AutoTokenizer.from_pretrained(path)`` instantiates, or :class:`Unresolved`.

    Follows ``AutoTokenizer.from_pretrained`` (transformers 5) for a local directory with no
    ``tokenizer_type``/``gguf_file``/``mistral_format`` argument; each refusal below is a branch
    of it that this does not reproduce."""
    import transformers

    if not transformers.__version__.startswith("5."):
        raise Unresolved(f"transformers {transformers.__version__}: the class choice followed here is version 5's")
    where = str(path)
    if not os.path.isabs(where):
        # AutoTokenizer matches the path against Hub ids (MODEL_IDS_TO_TOKENIZERS_BACKEND, none
        # of which starts with "/"): an absolute path never matches, a relative one might
        raise Unresolved(f"relative path {where!r}")
    tok_config = _read_json(Path(where) / "tokenizer_config.json")
    config = _read_json(Path(where) / "config.json")
    if "auto_map" in tok_config or "auto_map" in config:
        raise Unresolved("the checkpoint names its own tokenizer code (auto_map)")
    if "model_name" in config:
        raise Unresolved("config.json sets model_name (checked against transformers' full override list)")
    model_type = config.get("model_type")
    if model_type not in REGISTERED:
        raise Unresolved(f"model_type {model_type!r} is not in this module's snapshot of transformers' tables")

    registered = REGISTERED[model_type]
    if registered is _MISTRAL:
        from transformers.utils.import_utils import is_mistral_common_available
        registered = "MistralCommonBackend" if is_mistral_common_available() else "TokenizersBackend"
    hub_class = tok_config.get("tokenizer_class") or config.get("tokenizer_class")

    # the checkpoint's class disagrees with the one registered for its model type
    if hub_class is not None and registered is not None and \
            registered.removesuffix("Fast") != hub_class.removesuffix("Fast"):
        registered = registered.removesuffix("Fast")
        if registered not in (*_GENERIC, "MistralCommonBackend"):
            cls = _class_named(registered if model_type in HUB_CLASS_OVERRIDDEN else hub_class)
            if cls.__name__ not in _GENERIC:
                return cls
        if registered == "MistralCommonBackend" and _mistral_format(where):
            raise Unresolved("a Mistral tekken.json tokenizer (MistralCommonBackend)")
        return transformers.TokenizersBackend

    config_class = tok_config.get("tokenizer_class")
    if config_class is not None:
        config_class = config_class.removesuffix("Fast")
        cls = _class_named(config_class)
        return transformers.TokenizersBackend if cls.__name__ == "PythonBackend" else cls
    raise Unresolved("tokenizer_config.json names no tokenizer_class (AutoTokenizer then maps the config class)")


def _class_named(name: str):
    """``tokenization_auto.tokenizer_class_from_name`` in a process that registered no tokenizer
    class of its own: the class transformers exports under ``name``, else under ``name`` less
    "Fast". Exported under neither: transformers would still search its per-model-type modules
    (and may end at ``TokenizersBackend``), so that is :class:`Unresolved`, not a guess."""
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if name in ("BloomTokenizer", "BloomTokenizerFast", "TokenizersBackend"):
        return transformers.TokenizersBackend
    cls = getattr(transformers, name, None)
    if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
        return cls
    if cls is not None:
        raise Unresolved(f"transformers.{name} is not a usable tokenizer class here ({cls!r})")
    if name.endswith("Fast"):
        return _class_named(name[:-4])
    raise Unresolved(f"tokenizer class {name!r} is not exported by transformers")


def _mistral_format(where: str) -> bool:
    from transformers.integrations.mistral.tokenizer import resolve_mistral_format
    return bool(resolve_mistral_format(where)[0])


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Unresolved(f"no {path.name}") from None
    except (OSError, ValueError) as exc:
        raise Unresolved(f"{path.name} unreadable: {exc}") from None
