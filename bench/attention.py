"""Attention of a few queries over a long cache: which SDPA form reaches the memory floor.

``python -m bench.attention [--device cuda] [--keys 4096 32768] [--queries 1 16 45 512 2048]``

One layer's attention, Llama-3.1-8B-shaped by default (32 query heads, 8 kv heads, head_dim 128,
bf16 on a GPU, fp32 on CPU), the keys and values one [1, kv_heads, n, d] view each (as the
engine's buffer gives them). Per (queries q, keys n), median of ``--reps``:

- ``mask``: SDPA with a boolean [q x n] lower-right causal mask and ``enable_gqa`` (the engine's
  form on CPU, and on CUDA before ``causal_lower_right``);
- ``bias``: SDPA with ``torch.nn.attention.bias.causal_lower_right(q, n)`` and ``enable_gqa``
  (what :func:`kvruntime.inplace.attend` passes on CUDA: the flash kernel, no mask);
- ``expand``: K/V repeated to the query heads, then the boolean mask (transformers' sdpa path);
- ``none``: q = 1 needs no mask: SDPA with ``enable_gqa`` alone.

Each row: milliseconds, and GB/s over the K/V bytes read once (the floor of a few-query
attention is those bytes at the device's copy bandwidth, printed first).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def _time(fn, reps: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attention")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--keys", type=int, nargs="+", default=None)
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 16, 45, 512, 2048])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    dtype = getattr(torch, a.dtype or ("bfloat16" if gpu else "float32"))
    keys = a.keys or ([4096, 32768] if gpu else [1024, 4096])
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    x = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / _time(lambda: y.copy_(x), 5, sync)
    del x, y
    name = torch.cuda.get_device_name(dev) if gpu else "CPU"
    print(f"device: {name}; {dtype}; copy {bw / 1e9:.0f} GB/s (read + write); heads {a.heads}/{a.kv_heads}, "
          f"head_dim {a.head_dim}; median of {a.reps}")
    print("| keys | queries | kv MB | floor ms | mask ms | bias ms | expand ms | none ms | best GB/s | bias vs mask |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = a.heads // a.kv_heads
    for n in keys:
        k = torch.randn(1, a.kv_heads, n, a.head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        for q in a.queries:
            if q > n:
                continue
            qs = torch.randn(1, a.heads, q, a.head_dim, device=dev, dtype=dtype)
            m = torch.arange(n - q, n, device=dev)[:, None] >= torch.arange(n, device=dev)[None, :]
            row = {}
            row["mask"] = _time(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=m, enable_gqa=True),
                                a.reps, sync)
            if q > 1:
                bias = causal_lower_right(q, n)
                row["bias"] = _time(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=bias,
                                                                           enable_gqa=True), a.reps, sync)
            row["expand"] = _time(lambda: F.scaled_dot_product_attention(
                qs, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=m), a.reps, sync)
            if q == 1:
                row["none"] = _time(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), a.reps, sync)
            diff = "-"
            if q > 1:
                d = (F.scaled_dot_product_attention(qs, k, v, attn_mask=bias, enable_gqa=True)
                     - F.scaled_dot_product_attention(qs, k, v, attn_mask=m, enable_gqa=True)).abs().max()
                diff = f"{float(d):.1e}"
            best = min(row.values())
            cells = " | ".join(f"{row[c] * 1e3:.2f}" if c in row else "-" for c in ("mask", "bias", "expand", "none"))
            print(f"| {n} | {q} | {kv_bytes / 1e6:.0f} | {kv_bytes / bw * 1e3:.2f} | {cells} | "
                  f"{kv_bytes / best / 1e9:.0f} | {diff} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
