"""One worker actor's start, before and after a change, side by side: each run is a fresh Python
process that imports and constructs what a Ray prefill / decode actor constructs
(``PrefillWorker`` / ``DecodeWorker`` with the default config: SmolLM2, a 256 MiB tier), the two
source trees alternating round by round so both see the same load. Reports the whole process'
CPU seconds (imports + ``__init__``; the Python start itself excluded) and wall seconds, with the
1-minute load average before each run. No Ray is started (outside Ray the actor's Ray look-ups
answer "no node"), so this is the setup cost alone, not Ray's scheduling.

    git archive <before-rev> | tar -x -C /tmp/before
    .venv/bin/python -m bench.worker_start --before /tmp/before --after . --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = """
import os, sys, time, tempfile
t0 = time.perf_counter()
from kvruntime.config import ClusterConfig
cfg = ClusterConfig.of(port=18555, tier_cpu_bytes=256 << 20, data_dir=tempfile.mkdtemp())
if sys.argv[1] == "prefill":
    from prefill_workers.actor import PrefillWorker
    w = PrefillWorker(cfg, 0)
    assert w.engine.rope.enabled, w.engine.rope.self_test_error
else:
    from decode_workers.actor import DecodeWorker
    w = DecodeWorker(cfg, 0, host="127.0.0.1")
print(f"RESULT {time.process_time():.3f} {time.perf_counter() - t0:.3f}", flush=True)
os._exit(0)
"""


def one_start(src: str, which: str) -> tuple[float, float]:
    """(CPU s, wall s) of one actor's start from source tree ``src`` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as cwd:     # not the repo: ``src`` alone is on the path
        out = subprocess.run([sys.executable, "-c", _CHILD, which], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"{which} start from {src} failed (rc {out.returncode}): {out.stderr[-2000:]}")
    _, cpu, wall = line[-1].split()
    return float(cpu), float(wall)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="source tree before the change")
    ap.add_argument("--after", required=True, help="source tree after the change")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default="prefill,decode")
    a = ap.parse_args(argv)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(a.rounds):
        for which in a.workers.split(","):
            for tag, src in (("before", a.before), ("after", a.after)):
                load = os.getloadavg()[0]
                cpu, wall = one_start(src, which)
                runs.setdefault((which, tag), []).append((cpu, wall))
                print(f"round {r} {which:7s} {tag:6s} cpu {cpu:6.2f} s wall {wall:6.2f} s  (load {load:.2f})", flush=True)
    print(f"\n| worker | before CPU s | after CPU s | before wall s | after wall s |  ({time.strftime('%H:%M')} UTC, "
          f"load {os.getloadavg()[0]:.2f}; medians of {a.rounds})")
    print("|---|---|---|---|---|")
    for which in a.workers.split(","):
        b, f = runs[(which, "before")], runs[(which, "after")]
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        print(f"| {which} | {med(b, 0):.2f} | {med(f, 0):.2f} | {med(b, 1):.2f} | {med(f, 1):.2f} |")


if __name__ == "__main__":
    main()
