"""Reference decode: seconds per generated token, the old loop (a fresh HF cache per step plus a
whole-cache concatenation) against :class:`~kvruntime.decode_cache.DecodeSession` (the context
copied once into a preallocated buffer), side by side at each context size in one process.

Run: ``python -m bench.decode_step [--sizes 512 2048 4096] [--tokens 16]``. Both loops start from
the same context KV and emit the same greedy tokens (checked); the context prefill is not timed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _old(engine, kv, logits, n):
    """Greedy decoding as the reference engine did it before DecodeSession: a fresh HF cache per
    step and a whole-cache concatenation (kept as the oracle for tests/test_decode_cache.py)."""
    from kvruntime.kv import KVCache
    out, pos = [], int(kv.positions.max()) + 1
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        step = engine.prefill([tok], [pos], kv, logits=True)
        kv, logits, pos = KVCache.cat([kv, step.kv]), step.logits, pos + 1
    return out


def main(argv=None) -> int:
    from bench.progress import progress as _progress

    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_passages
    from kvruntime.ops import recompute

    ap = argparse.ArgumentParser(prog="python -m bench.decode_step")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per loop and repetition")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.reps < 1 or min(a.sizes) < 16:
        ap.error("--tokens >= 2, --reps >= 1 and every size >= 16")
    torch.set_num_threads(a.threads)
    e = ReferenceEngine(a.model, dtype="float32", threads=a.threads)
    text = "\n\n".join(load_passages().values()) * 8
    rows = []
    for size in _progress(a.sizes, "context sizes"):
        ids = e.encode(text)[:size]
        ctx = recompute(e, ids)
        t_old, t_new = [], []
        for _ in range(a.reps):                        # interleaved, so both see the same machine state
            t = time.perf_counter()
            old = _old(e, ctx.kv, ctx.logits, a.tokens)
            t_old.append((time.perf_counter() - t) / a.tokens)
            t = time.perf_counter()
            new = e.greedy(ctx.kv, ctx.logits, a.tokens)
            t_new.append((time.perf_counter() - t) / a.tokens)
            if new != old:
                raise SystemExit(f"tokens differ at {size}: {old} vs {new}")
        rows.append((size, statistics.median(t_old), statistics.median(t_new)))
    print(f"# python -m bench.decode_step --model {a.model} --sizes {' '.join(map(str, a.sizes))} "
          f"--tokens {a.tokens} --reps {a.reps} --threads {a.threads}")
    print("| context tokens | old loop s/token | DecodeSession s/token | speed-up |")
    print("|---|---|---|---|")
    for size, o, n in rows:
        print(f"| {size} | {o:.4f} | {n:.4f} | {o / n:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
