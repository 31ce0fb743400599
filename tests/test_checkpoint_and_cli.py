"""Checkpoint cache and the command line."""
import json
import subprocess
import sys

import pytest

from kvruntime.checkpoint import ensure_checkpoint
from kvruntime.models import get_model_spec


@pytest.mark.slow
def test_checkpoint_is_cached_and_clean():
    d1 = ensure_checkpoint(get_model_spec("smollm2-135m"))
    d2 = ensure_checkpoint(get_model_spec("smollm2-135m"))
    assert d1 == d2 and (d1 / "model.safetensors").exists()
    cfg = json.loads((d1 / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert len(cfg["kvnotes_source_gguf_sha256"]) == 64 and cfg["kvnotes_source_gguf_sha256"][:16] in d1.name


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cluster.operator.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_lists_models():
    r = _cli("models")
    assert r.returncode == 0 and r.stdout.split() == ["gemma3-270m", "smollm2-135m"]


def test_cli_bad_model_is_one_line_error():
    r = _cli("eval", "fidelity", "--model", "gpt-7")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kvnotes: error: unknown model 'gpt-7'")
    assert "Traceback" not in r.stderr


def test_cli_bad_limit_is_one_line_error():
    r = _cli("eval", "fidelity", "--limit", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--limit" in r.stderr
