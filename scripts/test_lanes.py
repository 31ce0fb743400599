"""The whole test suite in two lanes at once (``scripts/dev.sh test`` with no arguments, and CI).

Lane ``ray``: every test that runs a Ray cluster (marker ``ray``, tests/conftest.py), in one pytest
process, one after another: they share one local Ray and must never find another one. Lane ``rest``:
every other test (engines, kernels, transports, stores, CLIs), in a second pytest process at the same
time, with one OpenMP thread per process. Measured on a 2-core machine, one after another: the Ray
tests kept ~1.4 cores busy for 22 minutes, the rest ~1.1 cores for 16 (38-40 minutes in all); side
by side, 1605-1648 s (~27 minutes): the machine is busy instead of half idle. Tests that run a
private multi-node Ray by address (test_node_loss, test_multinode, the fake autoscaler) are in the
second lane, to balance the two.

Each lane writes its log under ``--logs`` (default: a temp dir), a progress line per lane every
minute goes to stdout, and at the end both reports are printed in full (failures, the 25 slowest
tests) followed by one summary line per lane. The exit status is the first lane's non-zero one.
Extra arguments go to both pytest processes (a lane that selects nothing counts as passed).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANES = (("ray", "ray", {}), ("rest", "not ray", {"OMP_NUM_THREADS": "1"}))
NO_TESTS = 5                                  # pytest's exit status when a selection is empty
PROGRESS = re.compile(r"\[\s*(\d+)%\]")


def _last_progress(log: Path) -> str:
    try:
        tail = log.read_bytes()[-4000:].decode(errors="replace")
    except OSError:
        return "starting"
    hits = PROGRESS.findall(tail)
    return f"{hits[-1]}%" if hits else "collecting"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", default=None, help="directory for each lane's log (default: a new temp dir)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between progress lines")
    args, extra = ap.parse_known_args(argv)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="kvnotes-tests-"))
    logs.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.gettempdir()) / f"kvnotes-pytest-{os.getuid()}"     # each lane's own --basetemp in it
    base.mkdir(parents=True, exist_ok=True)
    procs = []
    t0 = time.monotonic()
    for name, expr, env_extra in LANES:
        log = logs / f"{name}.log"
        cmd = [sys.executable, "-m", "pytest", "-m", expr, "--durations=25", f"--basetemp={base / name}",
               "-o", f"cache_dir={ROOT / '.pytest_cache' / name}", *extra]
        env = {**os.environ, "PYTHONHASHSEED": "0", **env_extra}
        with log.open("wb") as out:
            procs.append((name, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)))
    print(f"kvnotes tests: lanes {', '.join(n for n, _, _ in LANES)}; logs in {logs}", flush=True)
    ended: dict[str, tuple[int, float]] = {}
    next_line = time.monotonic() + args.every
    try:
        while len(ended) < len(procs):
            time.sleep(1)
            for name, _, p in procs:
                if name not in ended and p.poll() is not None:
                    ended[name] = (p.returncode, time.monotonic() - t0)
            if time.monotonic() >= next_line:
                next_line += args.every
                state = "; ".join(f"{n}: " + (f"done ({ended[n][0]})" if n in ended else _last_progress(log))
                                  for n, log, _ in procs)
                print(f"[{time.monotonic() - t0:6.0f} s] {state}", flush=True)
    except KeyboardInterrupt:
        for _, _, p in procs:
            p.terminate()
        for _, _, p in procs:
            p.wait(timeout=60)
        raise
    rc = 0
    for name, log, _ in procs:
        print(f"\n{'=' * 30} lane {name} ({log}) {'=' * 30}", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    print()
    for name, log, _ in procs:
        code, wall = ended[name]
        last = next((ln for ln in reversed(log.read_text(errors="replace").splitlines()) if ln.strip()), "")
        print(f"lane {name}: exit {code} after {wall:.0f} s: {last.strip('= ')}")
        if code not in (0, NO_TESTS) and rc == 0:
            rc = code
    print(f"kvnotes tests: {time.monotonic() - t0:.0f} s in all; load average {os.getloadavg()[0]:.1f}")
    if all(ended[n][0] == NO_TESTS for n, _, _ in procs):
        return NO_TESTS
    return rc


if __name__ == "__main__":
    sys.exit(main())
