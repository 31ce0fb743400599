"""``python -m bench.engine --target-only`` on a tiny random-weight llama shape: the bucketed vs
eager rows (one per new-token count, its bucket, both byte floors) and their logits agreeing."""
from __future__ import annotations

import re

import pytest


@pytest.mark.slow
def test_bucketed_rows_name_the_bucket_and_agree(capsys):
    from bench.engine import main
    assert main(["--shape", "tiny", "--target-only", "--cached", "64", "--reps", "1", "--nominal-gbs", "100"]) == 0
    out = capsys.readouterr().out
    assert "bucketed/eager" in out and "at 100 GB/s nominal" in out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| [\d.]+ ms \| [\d.]+ ms \| [\d.]+x \| [\d.]+ ms \| [\d.]+ ms \| "
                      r"\(logits max diff ([\d.e+-]+)\)$", out, re.M)
    assert [(int(q), int(b)) for q, b, _ in rows] == [(1, 1), (3, 4), (4, 4), (16, 16), (45, 64)]
    assert all(float(d) <= 1e-4 for _, _, d in rows), rows
