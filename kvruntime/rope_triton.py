"""The GPU re-rotation kernel (Triton): one pass over the keys, written into their destination
slots (or in place), called by :func:`kvruntime.rope.rotate_fused` for CUDA keys.

Why: in torch ops a rotation is a cast, a multiply and two fused multiply-adds, each a full pass
over the keys plus an fp32 temporary of their size; on an H200 that ran at 175-345 GB/s in bf16,
8-17% of a device copy. This kernel reads each key once and writes it once (fp32 arithmetic,
stored in the destination's dtype), so its floor is a copy's. Each program rotates one (layer,
head) row of ``BLOCK_T`` tokens: the (j, j + half) pairs of the first ``rotary_dim`` dims by
``cos``/``sin`` rows ([rows, 1 | tokens, half] fp32, one row per distinct frequency table: Gemma-3's
two bases), and copies dims past ``rotary_dim`` unless in place.

Without Triton (not importable, or ``KVNOTES_TRITON_ROPE=0``) :func:`rotate` returns False and the
caller runs torch ops; :func:`status` says which, and the choice is logged once. Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (how the tests check its math on a
host without a GPU).
"""
from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_kernel = None
_error: str | None = None          # why the Triton kernel is unavailable (None: not tried, or loaded)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _define():
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_rotate(x_ptr, o_ptr, c_ptr, s_ptr, row_ptr,
                     n_heads, n_tok,
                     xs_l, xs_h, xs_t, os_l, os_h, os_t,
                     cs_r, cs_t,
                     HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_TAIL: tl.constexpr, BLOCK_T: tl.constexpr, IN_PLACE: tl.constexpr):
        lh = tl.program_id(0)
        layer = lh // n_heads
        head = lh % n_heads
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, BLOCK_HALF)
        tmask = t < n_tok
        m = tmask[:, None] & (j < HALF)[None, :]
        xb = x_ptr + layer.to(tl.int64) * xs_l + head.to(tl.int64) * xs_h + t.to(tl.int64)[:, None] * xs_t
        ob = o_ptr + layer.to(tl.int64) * os_l + head.to(tl.int64) * os_h + t.to(tl.int64)[:, None] * os_t
        row = tl.load(row_ptr + layer)
        cb = row.to(tl.int64) * cs_r + (t.to(tl.int64) * cs_t)[:, None] + j[None, :]
        c = tl.load(c_ptr + cb, mask=m, other=0.0)
        s = tl.load(s_ptr + cb, mask=m, other=0.0)
        x1 = tl.load(xb + j[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        tl.store(ob + j[None, :], y1.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(ob + HALF + j[None, :], y2.to(o_ptr.dtype.element_ty), mask=m)
        if not IN_PLACE:
            if BLOCK_TAIL > 0:                       # dims past rotary_dim: copied
                k = 2 * HALF + tl.arange(0, BLOCK_TAIL)
                mt = tmask[:, None] & (k < HEAD_DIM)[None, :]
                tail = tl.load(xb + k[None, :], mask=mt, other=0.0)
                tl.store(ob + k[None, :], tail.to(o_ptr.dtype.element_ty), mask=mt)

    return triton, _rope_rotate


def _load():
    global _kernel, _error
    if _kernel is not None or _error is not None:
        return _kernel
    with _lock:
        if _kernel is None and _error is None:
            if os.environ.get("KVNOTES_TRITON_ROPE", "1") == "0":
                _error = "disabled by KVNOTES_TRITON_ROPE=0"
            else:
                try:
                    _kernel = _define()
                except Exception as exc:       # no triton: torch ops instead
                    _error = f"{type(exc).__name__}: {exc}"
            if _kernel is None:
                log.warning("Triton RoPE kernel unavailable (%s): GPU re-rotation uses torch ops", _error)
            else:
                log.info("Triton RoPE kernel defined")
    return _kernel


def status() -> str:
    """``"triton"`` or ``"torch (<why>)"``: which implementation GPU rotations use."""
    return "triton" if _load() is not None else f"torch ({_error})"


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels then take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_ROWS: dict = {}


def _rows(row_of: tuple, device: torch.device) -> torch.Tensor:
    """``row_of`` as an int32 tensor on ``device``, made once per (table, device): no host-to-device
    copy per rotation."""
    key = (row_of, str(device))
    t = _ROWS.get(key)
    if t is None:
        if len(_ROWS) > 64:
            _ROWS.clear()
        t = _ROWS[key] = torch.tensor(row_of, dtype=torch.int32, device=device)
    return t


def _block_t(half: int) -> int:
    return max(1, min(64, 4096 // max(16, 1 << (half - 1).bit_length())))


def rotate(keys: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           row_of: list[int], half: int, in_place: bool) -> bool:
    """Rotate ``keys`` [L, H, T, D] (fp32/bf16/fp16, last dim contiguous) into ``out`` (same shape,
    one of those dtypes; ``keys`` itself when ``in_place``) with ``cos``/``sin`` [rows, 1 | T, half]
    fp32 (last dim contiguous; sin with its sign: y1 = x1 c - x2 s, y2 = x2 c + x1 s);
    ``row_of[l]``: layer l's row. False (nothing written) when the kernel is unavailable or the
    tensors do not fit it (not CUDA, unless interpreted); the caller then uses torch ops."""
    kern = _load()
    dev_ok = keys.device.type == "cuda" or (interpreted() and keys.device.type == "cpu")
    if (kern is None or not dev_ok or keys.dtype not in DTYPES or out.dtype not in DTYPES
            or keys.stride(-1) != 1 or out.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride()
            or cos.shape[-1] != half):
        return False
    triton, fn = kern
    n_layers, n_heads, n_tok, head_dim = keys.shape
    rows = _rows(tuple(row_of), keys.device)
    tail = head_dim - 2 * half
    bt = _block_t(half)
    grid = (n_layers * n_heads, triton.cdiv(n_tok, bt))
    cs_t = cos.stride(1) if cos.shape[1] > 1 else 0
    fn[grid](keys, out, cos, sin, rows, n_heads, n_tok,
             *keys.stride()[:3], *out.stride()[:3], cos.stride(0), cs_t,
             HALF=half, HEAD_DIM=head_dim, BLOCK_HALF=triton.next_power_of_2(half),
             BLOCK_TAIL=triton.next_power_of_2(tail) if tail > 0 else 0, BLOCK_T=bt, IN_PLACE=in_place)
    return True
