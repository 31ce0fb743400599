"""The native fp32 re-rotation kernel (``csrc/rope_rotate.c``): built once per source and host
with the system C compiler, loaded with ctypes, called by :func:`kvruntime.rope.rotate_fused`.

Why native: a rotation in torch ops is three passes per block, and each op's OpenMP region
waits on a descheduled thread whenever the cores are shared (measured 3-7x memcpy's time on
the 2-core dev host under load); the kernel is one pass, one fork/join. Without a compiler the
torch-op path runs instead: :func:`status` says which, and the choice is logged once.
The build goes to ``$KVNOTES_NATIVE_DIR`` (default ``<tmp>/kvnotes-native``), named by a hash
of the source and flags, written under a temporary name and renamed (workers may race).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("csrc") / "rope_rotate.c"
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None          # why the native kernel is unavailable (None: not tried, or loaded)


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = _SRC.read_bytes()
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS]).encode()).hexdigest()[:16]
    out_dir = Path(os.environ.get("KVNOTES_NATIVE_DIR") or Path(tempfile.gettempdir()) / "kvnotes-native")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"rope_rotate-{tag}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SRC)], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    p, L = ctypes.c_void_p, ctypes.c_long
    dll.kv_rope_rotate_f32.argtypes = [p, p, p, p, p, L, L, L, L, L, L, p, p, ctypes.c_int]
    dll.kv_rope_rotate_f32.restype = ctypes.c_int
    return dll


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            if os.environ.get("KVNOTES_NATIVE_ROPE", "1") == "0":
                _error = "disabled by KVNOTES_NATIVE_ROPE=0"
            else:
                try:
                    _lib = _build()
                except Exception as exc:       # no compiler, read-only tmp, ...: torch ops instead
                    _error = f"{type(exc).__name__}: {exc}"
            if _lib is None:
                log.warning("native RoPE kernel unavailable (%s): re-rotation uses torch ops", _error)
            else:
                log.info("native RoPE kernel loaded")
    return _lib


def status() -> str:
    """``"native"`` or ``"torch (<why>)"``: which implementation CPU fp32 rotations use."""
    return "native" if _load() is not None else f"torch ({_error})"


def rotate_f32(keys: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               row_of: list[int]) -> bool:
    """Rotate CPU fp32 ``keys`` [L, H, T, D] (last dim contiguous) into ``out`` (same, or keys
    itself) with ``cos``/``sin`` [rows, 1 | T, rot] contiguous fp32 ([c, c] and [-s, s]);
    ``row_of[l]``: the row of layer l. False (nothing written) when the kernel is unavailable
    or the tensors do not fit it; the caller then uses torch ops."""
    lib = _load()
    if (lib is None or keys.device.type != "cpu" or keys.dtype != torch.float32 or out.dtype != torch.float32
            or keys.stride(-1) != 1 or out.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        return False
    n_layers, n_heads, n_tok, head_dim = keys.shape
    rows = (ctypes.c_long * n_layers)(*row_of)
    xs = (ctypes.c_long * 3)(*keys.stride()[:3])
    os_ = (ctypes.c_long * 3)(*out.stride()[:3])
    lib.kv_rope_rotate_f32(keys.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows,
                           n_layers, n_heads, n_tok, head_dim, cos.shape[-1], cos.shape[1], xs, os_,
                           torch.get_num_threads())
    return True
