"""The kvnotes cache directory (converted checkpoints, content-hash memos, calibrated fidelity
profiles) and the file hash they are keyed by. No imports from the rest of kvruntime."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVNOTES_CACHE`` or ``~/.cache/kvnotes``."""
    return Path(os.environ.get("KVNOTES_CACHE", Path.home() / ".cache" / "kvnotes"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
