"""Key re-rotation against its floor: the fused rotation (:func:`kvruntime.rope.rotate_fused`,
constant delta into a caller's buffer: what the prefill executor does per chunk) against memcpy
of the same bytes (``out.copy_(keys)``) and against the old fp64 path (:func:`rotate_keys`),
side by side in one process, interleaved ``--reps`` times; medians.

Run: ``python -m bench.rotate [--tokens 1024 4096 8192] [--reps 5] [--json]``. Keys are
SmolLM2-135M-shaped by default (30 layers, 3 kv heads, head_dim 64, fp32), a strided view
``data[:, 0]`` of the [layers, 2, kv_heads, tokens, head_dim] KV layout. GB/s counts the keys'
bytes once. Rows: one per token count, with ``fused_of_memcpy`` (target >= 0.5),
``fused_per_token_of_memcpy`` (one delta per slot) and ``fused_vs_fp64`` (speed-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(fn, times: list[float]) -> None:
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)


def run(tokens: int, layers: int, heads: int, head_dim: int, reps: int, fp64_reps: int) -> dict:
    from kvruntime.rope import rotate_fused, rotate_keys

    half = head_dim // 2
    inv = (1.0 / 100000.0 ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim)).repeat(layers, 1)
    data = torch.randn(layers, 2, heads, tokens, head_dim)
    keys = data[:, 0]
    out = torch.empty(layers, heads, tokens, head_dim)
    per_slot = torch.arange(tokens) * 3 - tokens
    variants = {
        "memcpy": lambda: out.copy_(keys),
        "fused": lambda: rotate_fused(keys, 1000, inv, out=out),
        "fused_per_token": lambda: rotate_fused(keys, per_slot, inv, out=out),
        "fp64": lambda: rotate_keys(keys, 1000, inv),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():            # warm-up: page faults, the native kernel's build
        fn()
    for rep in range(reps):                 # interleaved: every variant sees the same machine state
        for name, fn in variants.items():
            if name != "fp64" or rep < fp64_reps:
                _timed(fn, times[name])
    nbytes = keys.numel() * keys.element_size()
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: round(nbytes / s / 1e9, 2) for k, s in med.items()}
    return {"tokens": tokens, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "mib": round(nbytes / 2**20, 1),
            "reps": reps, "fp64_reps": min(reps, fp64_reps), "threads": torch.get_num_threads(),
            "ms": {k: float(f"{s * 1e3:.4g}") for k, s in med.items()}, "gbps": gbps,
            "fused_of_memcpy": round(med["memcpy"] / med["fused"], 3),
            "fused_per_token_of_memcpy": round(med["memcpy"] / med["fused_per_token"], 3),
            "fused_vs_fp64": round(med["fp64"] / med["fused"], 1)}


def main(argv=None) -> int:
    from kvruntime import rope_native

    ap = argparse.ArgumentParser(prog="python -m bench.rotate")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fp64-reps", type=int, default=2, help="timed runs of the slow fp64 path (of --reps)")
    ap.add_argument("--json", action="store_true", help="one JSON object per token count")
    a = ap.parse_args(argv)
    if min(a.tokens) < 1 or a.reps < 1 or a.fp64_reps < 1 or a.head_dim % 2:
        ap.error("--tokens, --reps and --fp64-reps must be >= 1 and --head-dim even")
    impl = rope_native.status()
    rows = []
    for n in a.tokens:
        row = {**run(n, a.layers, a.kv_heads, a.head_dim, a.reps, a.fp64_reps), "impl": impl}
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
    if not a.json:
        print(f"re-rotation of {a.layers}x{a.kv_heads}x{a.head_dim} fp32 keys, {impl}, "
              f"{torch.get_num_threads()} thread(s); medians of {a.reps} interleaved rep(s)")
        print(f"{'tokens':>7} {'MiB':>6} {'memcpy GB/s':>12} {'fused GB/s':>11} {'fused/memcpy':>13} "
              f"{'per-token/memcpy':>17} {'fp64 GB/s':>10} {'fused vs fp64':>14}")
        for r in rows:
            g = r["gbps"]
            print(f"{r['tokens']:>7} {r['mib']:>6} {g['memcpy']:>12} {g['fused']:>11} {r['fused_of_memcpy']:>13} "
                  f"{r['fused_per_token_of_memcpy']:>17} {g['fp64']:>10} {r['fused_vs_fp64']:>13}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
