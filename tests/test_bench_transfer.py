"""``python -m bench.transfer`` end to end at a tiny size: every transport row at once (ten Ray
actors must all be placed: a CPU share too large once left the fifth pair pending forever), real
NIXL and gRPC (unchecked on this host, and with ``checksum: always``), the ``grpc-raw`` ceiling
and the ``of_grpc_raw`` ratios. Numbers are not checked
(speed lives in the benchmark's own runs); that each row measured real bytes is."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["nixl", "nixl-copy", "grpc", "grpc-crc", "grpc-raw"]


def _stop_tree(proc: subprocess.Popen) -> None:
    """Stop the benchmark and everything it started (its Ray processes), by PID."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def test_every_row_in_one_run():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.transfer", "--json", "--reps", "1", "--mib", "2",
                             "--transports", ",".join(KINDS)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _stop_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"bench.transfer did not finish in 300 s; stderr tail:\n{err[-2000:]}")
    finally:
        if proc.poll() is None:
            _stop_tree(proc)
    assert proc.returncode == 0, err[-2000:]
    rows = {r["transport"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == {*KINDS, "copy"}
    for kind in KINDS:
        assert rows[kind]["mib"] == 2 and rows[kind]["gbps"] > 0 and rows[kind]["reps"] == 1
    assert rows["nixl"]["zero_copy"] is True and rows["nixl-copy"]["zero_copy"] is False
    for kind in ("grpc", "grpc-crc"):          # the share of gRPC's own ceiling, from the same run
        assert rows[kind]["of_grpc_raw"] == round(rows[kind]["gbps"] / rows["grpc-raw"]["gbps"], 3)
    # both actors are on this host: checksum auto sends unchecked, grpc-crc checks every block
    assert rows["grpc"]["checksum"] == "none" and rows["grpc-crc"]["checksum"] == "crc32c"
    assert "checksum" not in rows["nixl"] and "checksum" not in rows["grpc-raw"]
    assert "of_grpc_raw" not in rows["grpc-raw"] and "of_grpc_raw" not in rows["nixl"]


def test_unknown_transport_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.transfer", "--transports", "grpc,carrier-pigeon"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("unknown transport 'carrier-pigeon'")
