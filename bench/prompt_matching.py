"""What prompt matching costs the router: ``PromptMatcher.match`` on a plain prompt of N tokens
with F fingerprints held in the tenant's state store (SQLite in a temporary file, or Redis with
``--state redis://...``), in this process, no cluster.

    python -m bench.prompt_matching [--tokens 8192] [--fingerprints 10000] [--reps 30] [--state URL]
    python -m bench.control_path --matching ...        # the same row

The store is filled first with F fingerprints of earlier prompts (spans, each with the prompt
it was seen in, and anchors of compiled chunks); the measured prompt holds a registered chunk, a
compiled run, and otherwise text the store has never seen, and shares its tail with one kept
prompt at the same offsets (an edit candidate: the edit check reads it back and compares).
Timed: cutting the prompt (rolling hash, spans, anchors), the one batched store read (a read
only: the entries' LRU is refreshed when the prompt is recorded, after its answer), verifying
chunk matches, the spans this sighting makes recurring, reading the nearest prompt back and the
divergence check. Not timed: the tier lookup (one Ray call to a prefill worker, ``tier_lookup``
in ``bench.control_path``'s rows): it answers here at once from a set of the refs it was told
of. Reported: wall-clock min / median / p90 and the median CPU time of the matching thread (what
the work costs, whatever else the machine runs), with the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

from cluster.control.fingerprints import cut, fingerprint
from cluster.control.matching import MatchConfig, anchor_entries
from cluster.control.metrics import Metrics
from cluster.control.prompt_index import prompt_hash
from cluster.control.prompt_match import PromptMatcher
from cluster.control.state import StoreLimits, open_state
from kvruntime.messages.plan import KVRef

TENANT = "bench"


class HeldSet:
    """The tier, as a set of digests it answers from (the cluster's is one Ray call: not timed here)."""

    def __init__(self):
        self.digests: set[str] = set()

    async def present(self, refs, index=0, clock=None):
        return {r.digest for r in refs if r.digest in self.digests}


def fill(state, n: int, rng: random.Random, cfg: MatchConfig) -> None:
    """``n`` fingerprints of earlier prompts: their spans (counted once), where each was seen."""
    done = 0
    while done < n:
        ids = tuple(rng.randrange(1, 49000) for _ in range(2048))
        c = cut(TENANT, ids, cfg.spans)
        key = prompt_hash(TENANT, ids)
        state.count_fingerprints(TENANT, [s.key for s in c.spans], time.time())
        state.put_fingerprints(TENANT, {s.key: f"{key}@{s.start}" for s in c.spans}, time.time())
        done += len(c.spans)


def prompt(rng: random.Random, tokens: int, state, cfg: MatchConfig, held: HeldSet) -> tuple[int, ...]:
    """The measured prompt: new text, a registered 400-token chunk, a compiled 600-token run, and
    a tail equal to a kept prompt's at the same offsets (its spans point there: the kept prompt
    is an edit candidate, read back and compared, though 1,200 tokens differ, too many to edit)."""
    chunk = tuple(rng.randrange(1, 49000) for _ in range(400))
    run = tuple(rng.randrange(1, 49000) for _ in range(600))
    state.put_fingerprints(TENANT, {**anchor_entries("skill", "catalogue", TENANT, chunk, cfg.spans),
                                    **anchor_entries("span", fingerprint(TENANT, run)[:12], TENANT, run, cfg.spans)},
                           time.time())
    held.digests.add(KVRef(run, 0, "salt").digest)      # the compiled run is in the tier
    kept = tuple(rng.randrange(1, 49000) for _ in range(tokens))
    c = cut(TENANT, kept, cfg.spans)
    key = prompt_hash(TENANT, kept)
    state.put_held_prompt(TENANT, key, kept, time.time())
    state.put_fingerprints(TENANT, {s.key: f"{key}@{s.start}" for s in c.spans}, time.time())
    return tuple(rng.randrange(1, 49000) for _ in range(200)) + chunk + run + kept[1200:]


def measure(tokens: int, fingerprints: int, reps: int, url: str | None) -> dict:
    rng = random.Random(0)
    cfg = MatchConfig()
    tmp = tempfile.TemporaryDirectory(prefix="kvnotes-match-")
    state = open_state(url or f"sqlite:///{tmp.name}/state.db", StoreLimits(fingerprint_max=max(fingerprints * 2, 1)))
    held = HeldSet()
    fill(state, fingerprints, rng, cfg)
    ids = prompt(rng, tokens, state, cfg, held)
    matcher = PromptMatcher(state, None, Metrics(), held, 0, cfg)
    async def timed():
        out, cpu = [], []
        for _ in range(reps + 3):
            t, c = time.perf_counter(), time.thread_time()
            got = await matcher.match(TENANT, "salt", ids, 0, 0)
            out.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        return sorted(out[3:]), sorted(cpu[3:]), got
    times, cpu, found = asyncio.run(timed())
    size = state.sizes(time.time())["fingerprints"]
    state.close()
    tmp.cleanup()
    return {"tokens": len(ids), "fingerprints": size, "reps": reps, "min_ms": times[0] * 1e3,
            "median_ms": statistics.median(times) * 1e3, "load": os.getloadavg()[0], "cores": os.cpu_count(),
            "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3, "chunks": len(found.chunks),
            "cpu_median_ms": statistics.median(cpu) * 1e3,
            "spans": len(found.cut.spans), "anchors": len(found.cut.anchors),
            "store": (url or "sqlite").split(":")[0]}


def markdown(r: dict) -> str:
    return ("| prompt matching | tokens | fingerprints held | store | min ms | median ms | p90 ms | CPU median ms "
            "| spans / anchors | chunks found | load (cores) |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
            f"| PromptMatcher.match | {r['tokens']} | {r['fingerprints']} | {r['store']} | {r['min_ms']:.2f} | "
            f"{r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['cpu_median_ms']:.2f} | {r['spans']} / {r['anchors']} | "
            f"{r['chunks']} | {r['load']:.1f} ({r['cores']}) |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prompt_matching")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--fingerprints", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--state", default=None, help="a state URL (default: SQLite in a temporary file)")
    args = ap.parse_args(argv)
    if args.tokens < 1024 or args.fingerprints < 0 or args.reps < 1:
        ap.error("--tokens >= 1024, --fingerprints >= 0, --reps >= 1")
    print(markdown(measure(args.tokens, args.fingerprints, args.reps, args.state)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
