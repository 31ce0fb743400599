"""TTFT of full recompute vs reposition + seam repair (+ selective recompute of a share r of the
chunk tokens, ``kvruntime.ops.blend``), contexts where >= 90% of tokens are precompiled chunks.
Run: ``python -m bench.compose_ttft [--sizes 1024 2048 4096 8192] [--ratios 0 0.05 0.1 0.2] [--probe kv1]``.

For r > 0 the compose time is split into its selective-recompute phases (medians): the probe
(ranking forwards) and the recompute forward of the chosen tokens (with the splice), each also
as a share of the full recompute's time: the speed-up is bounded by 1 / (that share + the rest).

Both sides run in this process on the reference engine, one after the other per size, so the
ratio is measured on the same machine state. TTFT here = time from having the request's
tokens (and, for compose, the chunks' KV in memory) to the first token's logits; the chunks
were precompiled earlier (not timed), as a tier would hold them.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from bench.progress import progress as _progress


def _chunks(engine, passages: list[str], total: int, chunk_tokens: int) -> list[list[int]]:
    """Token chunks of ``chunk_tokens`` cut from the shipped passages until ``total`` tokens."""
    stream: list[int] = []
    i = 0
    while len(stream) < total:
        stream += engine.encode(passages[i % len(passages)].strip() + "\n\n")
        i += 1
    return [stream[s:s + chunk_tokens] for s in range(0, total, chunk_tokens)]


def main(argv=None) -> int:
    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_passages
    from kvruntime.ops.frame import chat_frame
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk, recompute

    ap = argparse.ArgumentParser(prog="python -m bench.compose_ttft")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8000])  # 8000 + question fits 8192
    ap.add_argument("--chunk-tokens", type=int, default=512, help="tokens per precompiled chunk")
    ap.add_argument("--seam", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.0], help="selective-recompute shares r")
    ap.add_argument("--probe", default="kv1", help="selective-recompute probe (kv<N>, progressive)")
    args = ap.parse_args(argv)
    if args.reps < 1 or any(s < 128 for s in args.sizes):
        ap.error("--reps must be >= 1 and every size >= 128 tokens")
    if any(not 0 <= r <= 1 for r in args.ratios):
        ap.error("--ratios must be in [0, 1]")

    engine = ReferenceEngine(args.model, dtype=args.dtype, threads=args.threads)
    if max(args.sizes) + 64 > engine.spec.context_window:
        ap.error(f"largest size exceeds {args.model}'s context window ({engine.spec.context_window})")
    passages = list(load_passages().values())
    pre, suffix = chat_frame(engine), engine.spec.chat_user_suffix
    q = engine.encode("Summarise the key facts above in one sentence." + suffix)
    print(f"# compose TTFT: {args.model} {args.dtype}, {args.threads} threads, {platform.machine()}, "
          f"chunks of {args.chunk_tokens} tokens, seam {args.seam}, median of {args.reps}")
    print("| context tokens | precompiled | r | recompute TTFT (s) | reposition+seam (+r) TTFT (s) | speed-up | "
          "probe (s, % of recompute) | r recompute + splice (s, %) | KL | top-1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    from kvruntime.ops import blend
    phase = {"probe": 0.0, "blend": 0.0}
    real_probe, real_refine, real_sel = blend._probe_all, blend._refine, blend.selective_recompute

    def timed(key, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phase[key] += time.perf_counter() - t0
        return wrapper
    blend._probe_all, blend._refine = timed("probe", real_probe), timed("probe", real_refine)
    blend.selective_recompute = timed("blend", real_sel)
    from kvruntime.fidelity.metrics import kl_divergence
    for size in _progress(args.sizes, "context sizes"):
        body = size - len(pre) - len(q)
        chunks = _chunks(engine, passages, body, args.chunk_tokens)
        kvs = [precompile_chunk(engine, c) for c in chunks]                       # not timed: the tier's job
        ids = pre + [t for c in chunks for t in c] + q
        segs = [TextSegment(pre)] + [ChunkSegment(k) for k in kvs] + [TextSegment(q)]
        t_full, t_comp = [], {r: [] for r in args.ratios}
        t_probe, t_blend = {r: [] for r in args.ratios}, {r: [] for r in args.ratios}
        comp = {}
        for _ in range(args.reps):      # interleaved: every variant sees the same machine state
            t = time.perf_counter(); full = recompute(engine, ids); t_full.append(time.perf_counter() - t)
            for r in args.ratios:
                phase.update(probe=0.0, blend=0.0)
                t = time.perf_counter()
                comp[r] = compose(engine, segs, seam_tokens=args.seam, recompute_ratio=r, probe=args.probe)
                t_comp[r].append(time.perf_counter() - t)
                t_probe[r].append(phase["probe"])
                t_blend[r].append(phase["blend"] - phase["probe"])
        f = statistics.median(t_full)
        share = sum(len(x) for x in chunks) / len(ids)
        for r in args.ratios:
            c = statistics.median(t_comp[r])
            p, b = statistics.median(t_probe[r]), statistics.median(t_blend[r])
            print(f"| {len(ids)} | {share:.0%} | {r:.0%} | {f:.2f} | {c:.2f} | {f / c:.1f}x | "
                  f"{p:.2f} ({p / f:.0%}) | {b:.2f} ({b / f:.0%}) | "
                  f"{kl_divergence(full.logits, comp[r].logits):.3f} | "
                  f"{'yes' if int(full.logits.argmax()) == int(comp[r].logits.argmax()) else 'no'} |", flush=True)
        del full, comp, kvs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
