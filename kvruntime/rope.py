"""Key re-rotation ("reposition") and its startup self-test.

RoPE rotates each (j, j + rotary_dim/2) pair of a key by ``position * inv_freq[j]``. Moving a
cached key from position p to q is therefore one more rotation by ``(q - p) * inv_freq`` —
values are untouched. The frequencies are read from the loaded model's own rotary module per
layer type (Gemma-3: sliding layers base 1e4, global layers base 1e6), so linear / llama3 /
yarn frequency scaling is covered by construction; partial rotary rotates only the first
``rotary_dim`` dims (HF rotate_half / "neox" half-split layout: the one layout of
:mod:`kvruntime.kv`; transformers de-interleaves GGUF llama Q/K weights at load, so GGUF models
produce it too).

Two implementations: :func:`rotate_fused` (what :meth:`RopeTable.rotate` runs) computes the
angles in fp64 once, casts one cos/sin row per distinct frequency table (one for all layers
when they share ``inv_freq``) and rotates in fp32 in one blocked pass, into ``out`` or in place;
:func:`rotate_keys` is the fp64 reference the tests hold it to.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class RepositionDisabled(RuntimeError):
    """Repositioning was disabled because the startup self-test failed (or was never run)."""


@dataclass
class RopeTable:
    inv_freq: torch.Tensor       # [layers, rotary_dim // 2] float64: per-layer inverse frequencies
    head_dim: int                # key head dim; dims >= rotary_dim are not rotated
    enabled: bool = True         # False once the self-test failed: reposition() then refuses
    self_test_error: float | None = None  # max relative error of the last self-test

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[1]

    @staticmethod
    def from_model(model) -> "RopeTable":
        """Read per-layer inverse frequencies from an HF model's rotary embedding module."""
        cfg = model.config
        rot = model.model.rotary_emb
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        rows = []
        for lt in layer_types:
            freq = getattr(rot, f"{lt}_inv_freq", None)
            if freq is None:
                freq = rot.inv_freq
            rows.append(freq.detach().to("cpu", torch.float64))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return RopeTable(torch.stack(rows), int(head_dim))

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor | int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``keys`` [layers, kv_heads, tokens, head_dim] by ``delta`` positions into ``out``
        (same shape; may be ``keys`` itself: in place; None: a new tensor), returned.

        ``delta`` is an int or a [tokens] int64 tensor (per-slot shift). Cost: one streaming pass
        over the keys (:func:`rotate_fused`). Raises :class:`RepositionDisabled` if disabled.
        """
        if not self.enabled:
            raise RepositionDisabled(
                f"reposition is disabled: RoPE self-test failed (max rel. error {self.self_test_error})")
        if keys.shape[0] != self.inv_freq.shape[0] or keys.shape[-1] != self.head_dim:
            raise ValueError(f"keys {tuple(keys.shape)} do not match the RoPE table "
                             f"({self.inv_freq.shape[0]} layers, head_dim {self.head_dim})")
        return rotate_fused(keys, delta, self.inv_freq, out=out)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """The fp64 reference rotation (``inv_freq`` [layers, rotary_dim // 2]): returns a new tensor.
    Cost: an fp64 copy of the keys and [layers, tokens, rotary_dim // 2] fp64 cos/sin tables."""
    n_tok = keys.shape[2]
    d = torch.as_tensor(delta, dtype=torch.float64)
    d = d.expand(n_tok) if d.dim() == 0 else d.to(torch.float64)
    if d.shape != (n_tok,):
        raise ValueError(f"delta must be a scalar or [{n_tok}], got {tuple(d.shape)}")
    if n_tok == 0:
        return keys
    half = inv_freq.shape[1]
    angle = d.to(inv_freq.device)[None, :, None] * inv_freq[:, None, :]   # [layers, tokens, half]
    cos = torch.cos(angle)[:, None].to(keys.device)                       # [layers, 1, tokens, half]
    sin = torch.sin(angle)[:, None].to(keys.device)
    k = keys.to(torch.float64)
    x1, x2, rest = k[..., :half], k[..., half:2 * half], k[..., 2 * half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(keys.dtype)


_BLOCK_BYTES = 1 << 20   # torch-op path on CPU: ~1 MiB of keys at a time, so a block's passes stay in L2


def rotate_fused(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor, *,
                 out: torch.Tensor | None = None, impl: str = "auto",
                 block_bytes: int = _BLOCK_BYTES) -> torch.Tensor:
    """Rotate ``keys`` [layers, kv_heads, tokens, head_dim] (any float dtype, any strides) by
    ``delta`` (int, or [tokens] per-slot shifts) into ``out`` (same shape, any float dtype;
    ``keys`` itself: in place; None: a new tensor), returned.

    Angles are ``delta * inv_freq`` in fp64, cast once to cos/sin rows: one per distinct row of
    ``inv_freq`` ([layers, rotary_dim // 2]) for a constant delta, [tokens] rows for per-slot
    deltas. The rotation runs in fp32 (fp64 for fp64 keys), written in ``out``'s dtype.
    ``impl="auto"`` (:func:`rotation_path`): CPU fp32 runs the native one-pass kernel
    (:mod:`kvruntime.rope_native`) when it is built, CUDA fp32/bf16/fp16 the one-pass Triton
    kernel (:mod:`kvruntime.rope_triton`) when Triton imports; everything else (or
    ``impl="torch"``) runs three torch ops per ~``block_bytes`` block on CPU, per whole tensor
    on other devices. Cost: one read and one
    write of the keys, plus (torch path, in place or 16-bit) an fp32 copy of one block. Dims
    past rotary_dim are copied (untouched in place). Equal to :func:`rotate_keys` within fp32
    rounding: per element at most 1.75 * eps32 * (|x_j| + |x_j+half|) apart (cos/sin cast, two
    products, one sum, the reference's own cast)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if keys.dim() != 4:
        raise ValueError(f"keys must be [layers, kv_heads, tokens, head_dim], got {tuple(keys.shape)}")
    n_layers, n_heads, n_tok, head_dim = keys.shape
    half = inv_freq.shape[1]
    rot = 2 * half
    if inv_freq.dim() != 2 or inv_freq.shape[0] != n_layers or rot > head_dim:
        raise ValueError(f"inv_freq {tuple(inv_freq.shape)} does not fit keys {tuple(keys.shape)}")
    d = torch.as_tensor(delta).to(device=keys.device, dtype=torch.float64)
    if d.dim() != 0 and d.shape != (n_tok,):
        raise ValueError(f"delta must be a scalar or [{n_tok}], got {tuple(d.shape)}")
    if out is None:
        out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    elif out.shape != keys.shape or not out.is_floating_point() or out.device != keys.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} does not fit keys "
                         f"{tuple(keys.shape)} on {keys.device}")
    if keys.numel() == 0:
        return out
    in_place = out.data_ptr() == keys.data_ptr() and out.stride() == keys.stride()
    if not in_place and _overlaps(out, keys):
        raise ValueError("out overlaps keys without being keys: rotate in place or into separate memory")
    cd = torch.float64 if keys.dtype == torch.float64 else torch.float32
    cos, sin, rows = _tables(inv_freq, d, cd, keys.device)
    path = rotation_path(keys.device.type, keys.dtype, out.dtype, impl)
    if path == "native":
        from kvruntime import rope_native
        if rope_native.rotate_f32(keys, out, cos, sin, rows):
            return out
    elif path == "triton":
        from kvruntime import rope_triton
        if rope_triton.rotate(keys, out, cos[..., :half], sin[..., half:], rows, half, in_place):
            return out
        if impl == "triton":
            raise ValueError(f"impl='triton' cannot rotate these keys ({rope_triton.status()}; "
                             f"{keys.device}, {keys.dtype} -> {out.dtype}, last-dim strides "
                             f"{keys.stride(-1)}/{out.stride(-1)})")
    direct = not in_place and keys.dtype == out.dtype == cd
    if keys.device.type != "cpu":      # one kernel per op over the whole tensor
        if len(set(rows)) == 1:
            c, s = cos[0], sin[0]
        else:
            idx = torch.tensor(rows, device=keys.device)
            c, s = cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
        _rotate_block(keys, out, c, s, half, rot, direct, in_place)
        return out
    bt = max(1, block_bytes // max(1, n_heads * head_dim * max(4, keys.element_size())))
    for layer in range(n_layers):
        c, s = cos[rows[layer]], sin[rows[layer]]       # [1 | tokens, rotary_dim]
        for t0 in range(0, n_tok, bt):
            cb, sb = (c, s) if c.shape[0] == 1 else (c[t0:t0 + bt], s[t0:t0 + bt])
            _rotate_block(keys[layer, :, t0:t0 + bt], out[layer, :, t0:t0 + bt], cb, sb, half, rot, direct, in_place)
    return out


def rotation_path(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype, impl: str = "auto") -> str:
    """Which implementation :func:`rotate_fused` tries first: ``"native"`` (CPU fp32: the C kernel),
    ``"triton"`` (CUDA fp32/bf16/fp16: one Triton pass; or ``impl="triton"``, which the tests
    run on CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (torch ops: everything else, and
    the fallback of both kernels when unavailable)."""
    if impl == "torch":
        return "torch"
    from_16_32 = dtype in _KERNEL_DTYPES and out_dtype in _KERNEL_DTYPES
    if impl == "triton" or (device_type == "cuda" and from_16_32):
        return "triton"
    if device_type == "cpu" and dtype == out_dtype == torch.float32:
        return "native"
    return "torch"


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tables(inv_freq: torch.Tensor, d: torch.Tensor, cd: torch.dtype,
            device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(cos, sin, layer -> row)``: cos = [c, c] and sin = [-s, s], each [distinct inv_freq
    rows, 1 | tokens, rotary_dim] contiguous in ``cd``; angles in fp64, cast once."""
    uniq, inverse = torch.unique(inv_freq.detach().to("cpu", torch.float64), dim=0, return_inverse=True)
    angle = d.reshape(-1)[None, :, None] * uniq.to(device)[:, None, :]        # [rows, 1 | tokens, half] fp64
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.cat([c, c], -1).to(cd), torch.cat([-s, s], -1).to(cd), inverse.tolist()


def _rotate_block(x: torch.Tensor, o: torch.Tensor, c: torch.Tensor, s: torch.Tensor, half: int, rot: int,
                  direct: bool, in_place: bool) -> None:
    """``o[..., :rot] = x[..., :rot] * c + swap_halves(x[..., :rot]) * s``; ``c``/``s`` broadcast
    against the block. ``direct``: x and o are distinct and in the compute dtype (no scratch)."""
    xr, orr = x[..., :rot], o[..., :rot]
    if not direct:                      # x is o, or another dtype: read the block once in c's dtype
        xr = xr.to(c.dtype, copy=True)
        if o.dtype != c.dtype:
            orr = torch.empty_like(xr)
    torch.mul(xr, c, out=orr)
    orr[..., :half].addcmul_(xr[..., half:], s[..., :half])
    orr[..., half:].addcmul_(xr[..., :half], s[..., half:])
    if orr.data_ptr() != o.data_ptr():
        o[..., :rot].copy_(orr)
    if rot < x.shape[-1] and not in_place:
        o[..., rot:].copy_(x[..., rot:])


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (conservative: interleaved views count)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        end = t.data_ptr() + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        return t.data_ptr(), end
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def self_test_tolerance(dtype: torch.dtype, max_position: int) -> float:
    """The largest per-layer relative error a correct rotation may show in :func:`self_test`.

    Two roundings separate rotated keys from computed ones, neither of them the rotation's:
    the KV dtype (the model stores its keys rounded and applies RoPE with cos/sin cast to its
    dtype: a few units of ``eps``; 4 eps allowed) and the model's fp32 angles (transformers
    computes ``position * inv_freq`` in fp32: up to ``position * eps32 / 2`` radians on the
    fastest pair, where re-rotation computes fp64 angles; ``max_position * eps32`` allowed).
    fp32 at position 3001: 3.6e-4; bf16: 3.2e-2; fp16: 4.3e-3. Any wrong rotation (base, sign,
    half layout, a 1% frequency error) is 0.1-2 off."""
    eps = torch.finfo(dtype).eps
    return 4 * eps + max_position * torch.finfo(torch.float32).eps


SELF_TEST_TOKENS = 2   # one-token forwards per position (2 x this many in all); see self_test


def self_test(engine, rope: RopeTable, *, source: int = 7, target: int = 3001, tokens: int = SELF_TEST_TOKENS,
              tolerance: float | None = None) -> bool:
    """Check ``rope`` against the model: the keys the model computes for a token at ``source``,
    rotated to ``target``, must equal the keys it computes for that token at ``target``, in
    every layer (the worst layer's relative error below ``tolerance``; default
    :func:`self_test_tolerance` of the engine's dtype).

    Each of ``tokens`` tokens is run alone (a one-token forward): its attention is softmax over
    one score, so every hidden state is the same at both positions, bit for bit, in every
    layer, and the keys differ by the model's own RoPE alone. The test thereby checks the
    rotation (per layer: Gemma-3's two bases each) and not the forward's rounding, which in a
    deep 16-bit model drifts past any bound meant for the rotation (a 32-layer bf16 Llama
    drifted 4.9e-2 over 24 tokens, with a correct rotation). On failure ``rope.enabled``
    becomes False and the failure is logged; on success it becomes True. Cost: 2 * ``tokens``
    one-token forwards (smollm2-135m, CPU: ~75 ms each).

    Two tokens (not six, as before) test the same thing: every token's key covers every rotated
    pair of every kv head in every layer, the rotation checked is the same map for each token,
    and the statistic (worst layer's relative error) is an energy-weighted mean over those pairs
    that more tokens only average. Measured on smollm2-135m, fp32 and bf16, 1/2/3/6 tokens: a
    correct table 0.75-1.3e-5 (fp32) and 3.5-3.8e-3 (bf16); the wrong tables of
    tests/test_rope_selftest.py (base 1e4, sign, 1% frequency, half layout) 1.63/1.26/0.67/1.29
    with 2 tokens against 1.63/1.25/0.69/1.25 with 6: the margin to the tolerance (>= 20x in
    bf16) is unchanged, at a third of the forwards. Two, not one, so no single token's key
    (near zero in some pair by chance) is the only witness.
    """
    if tolerance is None:
        tolerance = self_test_tolerance(engine.dtype, target + tokens)
    ids = engine.encode("The quick brown fox jumps over the lazy dog while the committee reviews "
                        "the quarterly budget in Lisbon.")[:tokens]
    if not ids:
        raise ValueError("self_test needs at least one token")
    # keys [layers, kv_heads, 1, head_dim] per token, at source + i and target + i
    at_src = torch.cat([engine.prefill([t], [source + i]).kv.keys for i, t in enumerate(ids)], dim=2)
    at_dst = torch.cat([engine.prefill([t], [target + i]).kv.keys for i, t in enumerate(ids)], dim=2)
    was = rope.enabled
    rope.enabled = True
    try:
        rotated = rope.rotate(at_src.to(torch.float32), target - source)
    finally:
        rope.enabled = was
    ref = at_dst.to(torch.float32)
    per_layer = (rotated - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-12)
    worst = int(per_layer.argmax())
    err = float(per_layer[worst])
    rope.self_test_error = err
    rope.enabled = err < tolerance
    if rope.enabled:
        log.info("RoPE re-rotation self-test passed: worst layer %d rel. error %.2e < %.1e (%d -> %d, %s)",
                 worst, err, tolerance, source, target, engine.dtype)
    else:
        log.error("RoPE re-rotation self-test FAILED: layer %d rel. error %.2e >= %.1e (%s); reposition disabled",
                  worst, err, tolerance, engine.dtype)
    return rope.enabled
