"""KV tier throughput: store / lookup / retrieve GB/s per LMCache tier, next to a plain tensor
copy of the same bytes measured in the same run (the ceiling for a memory-to-memory move).

    python -m bench.tier_throughput [--tokens 1024,2048,4096,8192] [--tiers cpu,disk,fs,remote]

KV is synthetic (random) with the real model's shape (SmolLM2-135M: 30 layers, 3 KV heads,
head dim 64; fp32 = 45 KiB per token). Each tier is measured alone: ``cpu`` keeps chunks in
LMCache's local CPU memory; ``disk``, ``fs`` and ``remote`` run with ``local_cpu=False`` so every
get is served by that tier (the CPU buffer only stages the transfer). ``remote`` is an
``lmcache_server`` on 127.0.0.1 started and stopped by this script. GB/s = 1e9 bytes/s, best of
``--repeats``; lookup GB/s is the chunk's bytes over the lookup time (it moves no KV). Disk and
fs reads are likely served by the OS page cache. Each repeat stores a new key, then evicts it.
Two retrieve columns: into a new tensor (``get(key)``, pays page faults on fresh memory) and
into a preallocated one (``get(key, out=)``); their baselines are ``clone()`` (allocate + copy)
and ``copy_()`` into a warm tensor.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from kvruntime.kv import KVCache
from kvruntime.config import TierConfig
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.store import ChunkKey, key_positions, tenant_salt
from kvtransport.tier.server import start_tier_server, stop_tier_server

LAYERS, KV_HEADS, HEAD_DIM, MODEL = 30, 3, 64, "smollm2-135m"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


KEY = os.urandom(32)     # the lm:// tier key of this run (the server refuses anonymous clients)


def _tier_config(tier: str, tmp: Path, url: str | None, gb: float) -> TierConfig:
    if tier == "cpu":
        return TierConfig(cpu_bytes=int(gb * 2**30))
    if tier == "disk":
        return TierConfig(local_cpu=False, cpu_bytes=int(gb * 2**30), disk_path=str(tmp / "disk"),
                          disk_bytes=int(2 * gb * 2**30))
    if tier == "fs":
        return TierConfig(local_cpu=False, cpu_bytes=int(gb * 2**30), persist_dir=str(tmp / "fs"))
    if tier == "remote":
        return TierConfig(local_cpu=False, cpu_bytes=int(gb * 2**30), remote_url=url, remote_timeout_s=30)
    raise ValueError(f"unknown tier {tier!r}; choose from cpu, disk, fs, remote")


def measure(tier: str, tokens: list[int], repeats: int, tmp: Path, url: str | None) -> list[dict]:
    """One row per chunk size: seconds (best of ``repeats``) for store, lookup, retrieve, copy."""
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    gb = 2.2 * max(tokens) * per_token / 2**30 + 0.1
    store = LMCacheStore(MODEL, "float32", LAYERS, KV_HEADS, HEAD_DIM, _tier_config(tier, tmp, url, gb),
                         remote_key=KEY if tier == "remote" else None)
    rows, seq = [], 0
    try:
        for n in tokens:
            data = torch.randn(LAYERS, 2, KV_HEADS, n, HEAD_DIM)
            dst = torch.empty_like(data)
            copy_s = _best(lambda: dst.copy_(data), repeats)
            clone_s = _best(lambda: data.clone(), repeats)
            t_put, t_look, t_get, t_into, served = [], [], [], [], set()
            for _ in range(repeats):
                seq += 1
                key = ChunkKey.build(MODEL, "float32", "0", range(seq * 10_000, seq * 10_000 + n), tenant_salt("bench"), 1)
                kv = KVCache(data, key_positions(key), torch.tensor(key.token_ids))
                before = dict(store.stats.hits_by_tier)
                t0 = time.perf_counter(); store.put(key, kv); t_put.append(time.perf_counter() - t0)      # noqa: E702
                t0 = time.perf_counter(); hit = store.contains(key); t_look.append(time.perf_counter() - t0)  # noqa: E702
                t0 = time.perf_counter(); got = store.get(key); t_get.append(time.perf_counter() - t0)    # noqa: E702
                t0 = time.perf_counter(); into = store.get(key, out=dst); t_into.append(time.perf_counter() - t0)  # noqa: E702
                if not hit or got is None or into is None or not torch.equal(got.data, data) or not torch.equal(dst, data):
                    raise RuntimeError(f"{tier}: {n}-token chunk did not round-trip: {store.stats}")
                served |= {t for t, c in store.stats.hits_by_tier.items() if c != before.get(t, 0)}
                store.evict(key)
            rows.append(dict(tier=tier, tokens=n, nbytes=data.numel() * 4, store=min(t_put), lookup=min(t_look),
                             retrieve=min(t_get), into=min(t_into), copy=copy_s, clone=clone_s,
                             served=",".join(sorted(served))))
    finally:
        store.close()
    return rows


def render(rows: list[dict]) -> str:
    """GB/s per column; ratios: store and retrieve-into vs copy_, retrieve-new vs clone."""
    cols = [("store", "store"), ("lookup", "lookup"), ("retr new", "retrieve"), ("retr into", "into"),
            ("copy_", "copy"), ("clone", "clone")]
    head = (f"{'tier':<7}{'tokens':>7}{'MiB':>7}{'lookup ms':>10}" + "".join(f"{c:>11}" for c, _ in cols)
            + f"{'store/copy':>11}{'into/copy':>10}{'new/clone':>10}  served by")
    out = ["GB/s per operation (lookup moves no KV: its GB/s is the chunk size over the lookup time)", head,
           "-" * len(head)]
    for r in rows:
        g = {k: r["nbytes"] / r[k] / 1e9 for _, k in cols}
        out.append(f"{r['tier']:<7}{r['tokens']:>7}{r['nbytes'] / 2**20:>7.1f}{r['lookup'] * 1e3:>10.2f}"
                   + "".join(f"{g[k]:>11.2f}" for _, k in cols)
                   + f"{g['store'] / g['copy']:>11.3f}{g['into'] / g['copy']:>10.3f}"
                   f"{g['retrieve'] / g['clone']:>10.3f}  {r['served']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,2048,4096,8192", help="chunk sizes, comma-separated")
    ap.add_argument("--tiers", default="cpu,disk,fs,remote")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (set explicitly)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    tiers = args.tiers.split(",")
    if args.repeats < 1 or args.threads < 1 or min(tokens) < 1:
        raise SystemExit("--repeats, --threads and --tokens must be >= 1")
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvnotes-tier-bench-") as tmp:
        server = start_tier_server("127.0.0.1", 0, key=KEY, log_path=Path(tmp) / "server.log") if "remote" in tiers else None
        try:
            for tier in tiers:
                rows += measure(tier, tokens, args.repeats, Path(tmp), server.url if server else None)
        finally:
            if server is not None:
                stop_tier_server(server)
    print(f"KV tier throughput (LMCache 0.5.6, fp32 {MODEL} shape, torch threads={args.threads}, "
          f"best of {args.repeats}; GB = 1e9 bytes)")
    print(render(rows))


if __name__ == "__main__":
    main()
