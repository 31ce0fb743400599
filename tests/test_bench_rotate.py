"""``python -m bench.rotate`` end to end at a tiny size: one JSON row per token count, every
variant timed, ratios computed from the row's own medians. Numbers are not checked (speed lives
in the benchmark's own runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_rotate_rows_and_ratios():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    r = subprocess.run([sys.executable, "-m", "bench.rotate", "--json", "--tokens", "16", "40", "--layers", "3",
                        "--kv-heads", "2", "--head-dim", "16", "--reps", "2", "--fp64-reps", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["tokens"] for row in rows] == [16, 40]
    for row in rows:
        assert (row["layers"], row["kv_heads"], row["head_dim"], row["reps"], row["fp64_reps"]) == (3, 2, 16, 2, 1)
        assert set(row["ms"]) == set(row["gbps"]) == {"memcpy", "fused", "fused_per_token", "fused_in_place",
                                                      "torch_ops", "fp64"}
        assert (row["device"], row["dtype"]) == ("cpu", "float32")
        assert all(v > 0 for v in row["ms"].values())
        ms = row["ms"]   # the ratios are the medians' own (ms are printed to 4 significant digits)
        for key, a, b in (("fused_of_memcpy", "memcpy", "fused"), ("fused_per_token_of_memcpy", "memcpy",
                                                                    "fused_per_token"), ("fused_vs_fp64", "fp64", "fused"),
                          ("fused_in_place_of_memcpy", "memcpy", "fused_in_place"),
                          ("torch_ops_of_memcpy", "memcpy", "torch_ops")):
            assert abs(row[key] - ms[a] / ms[b]) <= 0.01 * ms[a] / ms[b] + 0.05, (key, row)
        assert row["impl"] == "native" or row["impl"].startswith("torch (")


def test_bench_rotate_rejects_bad_sizes():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "bench.rotate", "--tokens", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--tokens" in r.stderr


def test_bench_rotate_on_cuda_or_a_clear_error():
    """``--device cuda``: Llama-3-8B-shaped bf16 keys through the Triton kernel where a GPU is present;
    a one-line error naming the device where none is."""
    import torch
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    r = subprocess.run([sys.executable, "-m", "bench.rotate", "--device", "cuda", "--json", "--tokens", "64",
                        "--reps", "2", "--fp64-reps", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    if not torch.cuda.is_available():
        assert r.returncode != 0 and "CUDA is not available" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.splitlines()[0])
    assert (row["layers"], row["kv_heads"], row["head_dim"], row["dtype"]) == (32, 8, 128, "bfloat16")
    assert row["device"].startswith("cuda") and row["impl"] == "triton"
