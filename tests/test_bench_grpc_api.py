"""``python -m bench.grpc_api`` at a tiny size: every API shape and kvnotes' own transport move
the bytes between two real processes (the server checks the count it received); a bad variant is
a one-line error. Speed is the benchmark's business, not this test's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["sync/sync/tcp", "aio/aio/tcp", "sync/aio/tcp", "aio/sync/tcp", "sync/sync/uds", "transport/transport/tcp"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}


CHECKED = 'transport/transport/tcp+{"checksum": "always"}'


def test_every_variant_moves_the_bytes():
    proc = subprocess.run([sys.executable, "-m", "bench.grpc_api", "--json", "--mib", "4", "--reps", "2",
                           "--variants", ",".join(VARIANTS), "--transport-config", '{"checksum": "always"}'],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["variant"] for r in rows] == VARIANTS + [CHECKED]
    assert all(r["mib"] == 4 and r["reps"] == 2 and r["gbps"] > 0 for r in rows)
    # two timed repetitions per variant after a warm-up, interleaved across variants
    reps = [line.split(" rep ")[0] for line in proc.stderr.splitlines() if " rep " in line]
    assert reps == (VARIANTS + [CHECKED]) * 2


def test_bad_variant_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.grpc_api", "--variants", "sync/carrier-pigeon/tcp"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "variant 'sync/carrier-pigeon/tcp': expected server/client/socket with server and client in sync|aio, "
        "socket in tcp|uds, or transport/transport/tcp"]


def test_bad_transport_config_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.grpc_api", "--transport-config", '{"checksum": "never"}'],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("variant 'transport/transport/tcp+") and "checksum" in lines[0]
