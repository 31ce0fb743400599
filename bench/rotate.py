"""Key re-rotation against its floor: the fused rotation (:func:`kvruntime.rope.rotate_fused`,
constant delta into a caller's buffer: what the prefill executor does per chunk) against memcpy
of the same bytes (``out.copy_(keys)``) and against the old fp64 path (:func:`rotate_keys`),
side by side in one process, interleaved ``--reps`` times; medians.

Run: ``python -m bench.rotate [--tokens 1024 4096 8192] [--reps 5] [--json]``. Keys are
SmolLM2-135M-shaped by default (30 layers, 3 kv heads, head_dim 64, fp32), a strided view
``data[:, 0]`` of the [layers, 2, kv_heads, tokens, head_dim] KV layout. GB/s counts the keys'
bytes once. Rows: one per token count, with ``fused_of_memcpy`` (target >= 0.5),
``fused_per_token_of_memcpy`` (one delta per slot), ``fused_in_place_of_memcpy``,
``torch_ops_of_memcpy`` (the torch-op path, for comparison) and ``fused_vs_fp64`` (speed-up).

On a GPU: ``python -m bench.rotate --device cuda`` (Llama-3-8B-shaped bf16 keys: 32 layers, 8 kv
heads, head_dim 128; 4k-32k tokens): the Triton kernel against a device copy of the same bytes
(target >= 0.5 of it), timed with ``torch.cuda.synchronize`` around each call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(fn, times: list[float], sync) -> None:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    times.append(time.perf_counter() - t)


def run(tokens: int, layers: int, heads: int, head_dim: int, reps: int, fp64_reps: int,
        device: str = "cpu", dtype: str = "float32") -> dict:
    from kvruntime.rope import rotate_fused, rotate_keys

    dt = getattr(torch, dtype)
    half = head_dim // 2
    inv = (1.0 / 100000.0 ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim)).repeat(layers, 1)
    data = torch.randn(layers, 2, heads, tokens, head_dim, device=device).to(dt)
    keys = data[:, 0]
    out = torch.empty(layers, heads, tokens, head_dim, device=device, dtype=dt)
    per_slot = torch.arange(tokens, device=device) * 3 - tokens
    variants = {
        "memcpy": lambda: out.copy_(keys),
        "fused": lambda: rotate_fused(keys, 1000, inv, out=out),
        "fused_per_token": lambda: rotate_fused(keys, per_slot, inv, out=out),
        "fused_in_place": lambda: rotate_fused(out, 1000, inv, out=out),
        "torch_ops": lambda: rotate_fused(keys, 1000, inv, out=out, impl="torch"),
        "fp64": lambda: rotate_keys(keys, 1000, inv),
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():            # warm-up: page faults, the native kernel's build, Triton's JIT
        fn()
    for rep in range(reps):                 # interleaved: every variant sees the same machine state
        for name, fn in variants.items():
            if name != "fp64" or rep < fp64_reps:
                _timed(fn, times[name], sync)
    nbytes = keys.numel() * keys.element_size()
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: round(nbytes / s / 1e9, 2) for k, s in med.items()}
    return {"tokens": tokens, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "mib": round(nbytes / 2**20, 1),
            "device": str(torch.device(device)), "dtype": dtype, "reps": reps, "fp64_reps": min(reps, fp64_reps),
            "threads": torch.get_num_threads(),
            "ms": {k: float(f"{s * 1e3:.4g}") for k, s in med.items()}, "gbps": gbps,
            "fused_of_memcpy": round(med["memcpy"] / med["fused"], 3),
            "fused_per_token_of_memcpy": round(med["memcpy"] / med["fused_per_token"], 3),
            "fused_in_place_of_memcpy": round(med["memcpy"] / med["fused_in_place"], 3),
            "torch_ops_of_memcpy": round(med["memcpy"] / med["torch_ops"], 3),
            "fused_vs_fp64": round(med["fp64"] / med["fused"], 1)}


def main(argv=None) -> int:
    from kvruntime import rope_native, rope_triton

    ap = argparse.ArgumentParser(prog="python -m bench.rotate")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (cuda: the Triton kernel against a device copy)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="key dtype (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--shape", choices=["smollm2", "llama3-8b"], default=None,
                    help="smollm2: 30 layers x 3 kv heads x 64 (cpu default); llama3-8b: 32 x 8 x 128 (cuda default); "
                         "--layers/--kv-heads/--head-dim override")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 1024 4096 8192 (cuda: 4096 16384 32768)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fp64-reps", type=int, default=2, help="timed runs of the slow fp64 path (of --reps)")
    ap.add_argument("--json", action="store_true", help="one JSON object per token count")
    a = ap.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if not (cuda or a.device == "cpu"):
        ap.error(f"--device must be cpu or cuda[:N], got {a.device!r}")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: CUDA is not available on this host")
    shape = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}[a.shape or ("llama3-8b" if cuda else "smollm2")]
    layers, heads, head_dim = (a.layers or shape[0], a.kv_heads or shape[1], a.head_dim or shape[2])
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    tokens = a.tokens or ([4096, 16384, 32768] if cuda else [1024, 4096, 8192])
    if min(tokens) < 1 or a.reps < 1 or a.fp64_reps < 1 or head_dim % 2 or min(layers, heads) < 1:
        ap.error("--tokens, --layers, --kv-heads, --reps and --fp64-reps must be >= 1 and --head-dim even")
    impl = rope_triton.status() if cuda else (rope_native.status() if dtype == "float32" else "torch")
    where = torch.cuda.get_device_name(torch.device(a.device)) if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    rows = []
    for n in tokens:
        row = {**run(n, layers, heads, head_dim, a.reps, a.fp64_reps, a.device, dtype), "impl": impl,
               "device_name": where}
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
    if not a.json:
        print(f"re-rotation of {layers}x{heads}x{head_dim} {dtype} keys, {impl}, on {where}; "
              f"medians of {a.reps} interleaved rep(s); GB/s counts the keys' bytes once")
        print(f"{'tokens':>7} {'MiB':>7} {'copy GB/s':>10} {'fused GB/s':>11} {'fused/copy':>11} "
              f"{'per-token/copy':>15} {'in-place/copy':>14} {'torch-ops/copy':>15} {'fused vs fp64':>14}")
        for r in rows:
            g = r["gbps"]
            print(f"{r['tokens']:>7} {r['mib']:>7} {g['memcpy']:>10} {g['fused']:>11} {r['fused_of_memcpy']:>11} "
                  f"{r['fused_per_token_of_memcpy']:>15} {r['fused_in_place_of_memcpy']:>14} "
                  f"{r['torch_ops_of_memcpy']:>15} {r['fused_vs_fp64']:>13}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
