"""``kvruntime.tokenizer.load_tokenizer`` (the router's torch-free tokenizer load) gives what
``transformers.AutoTokenizer.from_pretrained`` gives, for every checkpoint the project serves: the
two shipped models and the tiny checkpoint of each supported family. Its snapshot of transformers'
class tables matches the installed transformers; what it cannot decide goes to AutoTokenizer,
logged and counted."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from kvruntime import tokenizer as kt

_TEXTS = ["hello world", "The Varga Museum opens at nine.", " leading space and  two spaces\n\nnewlines",
          "Ünïcödé, émoji 🙂 and digits 12345", "<|im_start|>user\nhi<|im_end|>", "<bos><eos><pad> x <s></s>",
          "<start_of_turn>user\nq<end_of_turn>", "<|begin_of_text|><|eot_id|>[INST] a [/INST]<|end|>"]
_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is <eos> here?"},
         {"role": "assistant", "content": "A token."}, {"role": "user", "content": "And again?"}]
_SHIPPED = ["smollm2-135m", "gemma3-270m"]
_FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def assert_same_tokenizer(ours, auto):
    """Same class, vocabulary, special tokens, chat template; same ids and chat rendering."""
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.special_tokens_map == auto.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, auto.unk_token_id)
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in auto.added_tokens_decoder.items()}
    assert ours.chat_template == auto.chat_template
    for text in _TEXTS:
        assert ours.encode(text) == auto.encode(text), text
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == auto.decode(ids), text
    if auto.chat_template is not None:
        for gen in (True, False):
            assert ours.apply_chat_template(_CHAT, tokenize=False, add_generation_prompt=gen) == \
                auto.apply_chat_template(_CHAT, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(_CHAT, add_generation_prompt=gen, return_dict=False) == \
                auto.apply_chat_template(_CHAT, add_generation_prompt=gen, return_dict=False)


def _same_as_auto(path, auto=None):
    """``auto``: AutoTokenizer's load of ``path`` where one is at hand (an engine's), else loaded here."""
    import transformers
    before = sum(kt.FALLBACKS.values())
    ours = kt.load_tokenizer(path)
    assert sum(kt.FALLBACKS.values()) == before, f"{path} went to AutoTokenizer: {dict(kt.FALLBACKS)}"
    assert_same_tokenizer(ours, auto or transformers.AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("model", _SHIPPED)
def test_a_shipped_model_loads_the_tokenizer_autotokenizer_loads(model):
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.models import get_model_spec
    from tests.conftest import get_engine
    e = get_engine(model)                   # the session's engine: its tokenizer is AutoTokenizer's
    path = ensure_checkpoint(get_model_spec(model))
    assert e.tokenizer.name_or_path == str(path), (e.tokenizer.name_or_path, path)
    _same_as_auto(path, e.tokenizer)


@pytest.mark.parametrize("family", _FAMILIES)
def test_a_family_checkpoint_loads_the_tokenizer_autotokenizer_loads(tiny_checkpoints, family):
    _same_as_auto(tiny_checkpoints[family])


def test_the_families_are_all_checked():
    """Every family the reference engine serves is in the snapshot and among the checkpoints above."""
    from kvruntime.hf_models import SUPPORTED
    from tests.tiny_checkpoints import configs, tokenizer
    assert set(SUPPORTED) <= set(kt.REGISTERED)
    assert set(_FAMILIES) == set(configs(tokenizer))
    assert {cfg.model_type for cfg, _ in configs(tokenizer).values()} == set(SUPPORTED)


def test_the_snapshot_matches_the_installed_transformers():
    """``REGISTERED`` / ``HUB_CLASS_OVERRIDDEN`` are transformers' own tables for those model types,
    and no Hub id AutoTokenizer special-cases can match an absolute path."""
    from transformers.models.auto import tokenization_auto as ta
    from transformers.utils.import_utils import is_mistral_common_available
    mistral = "MistralCommonBackend" if is_mistral_common_available() else "TokenizersBackend"
    ours = {mt: (mistral if v is kt._MISTRAL else v) for mt, v in kt.REGISTERED.items()}
    assert ours == {mt: ta.TOKENIZER_MAPPING_NAMES.get(mt) for mt in kt.REGISTERED}
    assert kt.HUB_CLASS_OVERRIDDEN == {mt for mt in kt.REGISTERED if mt in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS}
    assert all(p[0] not in "/*?[" for p in ta.MODEL_IDS_TO_TOKENIZERS_BACKEND), ta.MODEL_IDS_TO_TOKENIZERS_BACKEND


def test_what_it_cannot_decide_goes_to_autotokenizer_logged_and_counted(tiny_checkpoints, tmp_path, caplog):
    """A model type outside the snapshot: AutoTokenizer's own tokenizer (so still the same), one
    warning naming the reason, one count; a relative path likewise."""
    import transformers
    d = tmp_path / "other-type"
    shutil.copytree(tiny_checkpoints["llama3"], d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(kt.Unresolved, match="gpt2"):
        kt.tokenizer_class(d)
    before = kt.FALLBACKS.copy()
    with caplog.at_level(logging.WARNING, logger="kvruntime.tokenizer"):
        tok = kt.load_tokenizer(d)
    assert_same_tokenizer(tok, transformers.AutoTokenizer.from_pretrained(d))
    assert sum((kt.FALLBACKS - before).values()) == 1 and "gpt2" in next(iter(kt.FALLBACKS - before))
    assert any("AutoTokenizer" in r.getMessage() and "gpt2" in r.getMessage() for r in caplog.records)
    with pytest.raises(kt.Unresolved, match="relative path"):
        kt.tokenizer_class("some/relative/dir")
    remote = tmp_path / "remote-code"
    shutil.copytree(tiny_checkpoints["llama3"], remote, ignore=shutil.ignore_patterns("*.safetensors"))
    tc = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**tc, "auto_map": {"AutoTokenizer": [None, "x.Y"]}}))
    with pytest.raises(kt.Unresolved, match="auto_map"):
        kt.tokenizer_class(remote)
