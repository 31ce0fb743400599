"""Prefill build with and without tier-read prefetch (``PrefillExecutor(prefetch=...)``), in
process on the real LMCache-backed tier (``prefill_workers.tier_reads.PrefillTier``).

A composed context of ``--size`` tokens: the chat frame + the first chunk as one exact reuse
(the planner's frame variant), then chunks of ``--chunk-tokens`` repositioned (seam
``--seam``). With prefetch the tier read of chunk i+1 runs on a background thread while chunk i
is re-rotated into the prefix buffer; without, reads and rotation alternate. Both variants build the
same plan against the same tier, interleaved ``--reps`` times; medians of the build time and
of its stages (``tier_get`` is the time the build waited for a read), and of what the stages do
not cover: copying KV into the prefix buffer (the exact reuse's slots; before the buffer was
allocated once, the whole KV built so far at every step) and the executor's own overhead. The chunks' KV is stored
once before timing: random values of the model's KV shape (neither the tier nor the rotation
depends on them), so no forward pass is needed to set up.

Run: ``python -m bench.pipeline [--sizes 4096 8192] [--chunk-tokens 1024] [--reps 7]``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _plan(engine, salt: str, frame: list[int], size: int, chunk_tokens: int, seam: int, tier):
    from kvruntime.kv import KVCache
    from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan

    vocab = len(engine.tokenizer)
    gen = torch.Generator().manual_seed(size)
    shape = (engine.num_layers, 2, engine.kv_heads)
    steps, pos, k = [], 0, 0
    while pos < size:
        n = min(chunk_tokens, size - pos) if k else min(chunk_tokens, size) - len(frame)
        ids = tuple(int(t) for t in torch.randint(100, vocab - 100, (n,), generator=gen))
        if k == 0:                               # frame + first chunk: one exact entry from position 0
            ids = tuple(frame) + ids
            ref = KVRef(ids, 0, salt, prefix=())
            step = SegmentPlan(kind=PlanKind.REUSE, source="frame+skill:c0", token_ids=ids, position=0, computed=0,
                               reused=len(ids), kv=ref)
        else:                                    # a chunk compiled at its canonical position (after BOS)
            ref = KVRef(ids, 1, salt)
            step = SegmentPlan(kind=PlanKind.REPOSITION, source=f"skill:c{k}", token_ids=ids, position=pos,
                               computed=seam, reused=n - seam, kv=ref, seam_tokens=seam)
        data = torch.randn(*shape, len(ids), engine.head_dim, generator=gen).to(engine.dtype)
        tier.put(ref, KVCache(data, torch.arange(ref.position, ref.position + len(ids)), torch.tensor(ids)))
        steps.append(step)
        pos += len(ids)
        k += 1
    return RequestPlan(f"bench-{size}", engine.spec.name, Policy.FAST, tuple(steps), (1,))


def main(argv=None) -> int:
    from kvruntime.engine import ReferenceEngine
    from kvruntime.ops.frame import chat_frame
    from kvruntime.config import TierConfig
    from kvtransport.tier.lmcache_store import LMCacheStore
    from prefill_workers.executor import PrefillExecutor
    from prefill_workers.tier_reads import PrefillTier

    ap = argparse.ArgumentParser(prog="python -m bench.pipeline")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a prefill actor's)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--seam", type=int, default=0, help="seam tokens per repositioned chunk (0: KV path only)")
    ap.add_argument("--ahead", type=int, default=1, help="prefetch depth of the 'with' variant")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tier-gb", type=float, default=2.0)
    a = ap.parse_args(argv)
    if a.reps < 1 or a.ahead < 1 or a.chunk_tokens < 64 or min(a.sizes) <= a.chunk_tokens:
        ap.error("--reps and --ahead must be >= 1, --chunk-tokens >= 64 and every size above one chunk")

    engine = ReferenceEngine(a.model, dtype=a.dtype, threads=a.threads)
    store = LMCacheStore.for_engine(engine, TierConfig(cpu_bytes=int(a.tier_gb * 2**30)))
    tier = PrefillTier(store, engine)
    try:
        frame = chat_frame(engine)
        plans = {n: _plan(engine, "ab" * 16, frame, n, a.chunk_tokens, a.seam, tier) for n in a.sizes}
        ex = {0: PrefillExecutor(engine, tier, None, prefetch=0), a.ahead: PrefillExecutor(engine, tier, None,
                                                                                            prefetch=a.ahead)}
        print(f"# prefill build, tier read prefetch off vs on (depth {a.ahead}): {a.model} {a.dtype}, "
              f"{a.threads} torch thread(s), {torch.get_num_threads()} in use, chunks of {a.chunk_tokens} tokens, "
              f"seam {a.seam}, LMCache local CPU tier, median of {a.reps} interleaved reps")
        print("| tokens | chunks | KV (MB) | build off (ms) | build on (ms) | on / off | tier_get wait off / on (ms) | "
              "rerotate off / on (ms) | copy + rest off / on (ms) | copy + rest share off / on |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n, plan in plans.items():
            for e in ex.values():                          # warm-up: page faults, the native rotation
                kv, st = e.build(plan)
                assert not st.fallbacks and st.tier_hits == len(plan.steps), st
            times = {d: [] for d in ex}
            stages = {d: {"tier_get": [], "rerotate": [], "rest": []} for d in ex}
            for _ in range(a.reps):
                for d, e in ex.items():
                    t = time.perf_counter()
                    kv, st = e.build(plan)
                    times[d].append(time.perf_counter() - t)
                    for s in ("tier_get", "rerotate"):
                        stages[d][s].append(st.stages.get(s, 0.0))
                    stages[d]["rest"].append(times[d][-1] - sum(st.stages.values()))   # copies + overhead
                    mb = kv.nbytes / 1e6
                    del kv
            med = {d: statistics.median(v) * 1e3 for d, v in times.items()}
            sm = {d: {s: statistics.median(v) * 1e3 for s, v in stages[d].items()} for d in ex}
            off, on = 0, a.ahead
            print(f"| {plan.prefix_tokens} | {len(plan.steps)} | {mb:.0f} | {med[off]:.1f} | {med[on]:.1f} | "
                  f"{med[on] / med[off]:.2f} | {sm[off]['tier_get']:.1f} / {sm[on]['tier_get']:.1f} | "
                  f"{sm[off]['rerotate']:.1f} / {sm[on]['rerotate']:.1f} | {sm[off]['rest']:.1f} / "
                  f"{sm[on]['rest']:.1f} | {sm[off]['rest'] / med[off]:.0%} / {sm[on]['rest'] / med[on]:.0%} |",
                  flush=True)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
