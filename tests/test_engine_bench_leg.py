"""``python -m bench.engine --decode-leg-only`` on a tiny random-weight llama shape: one row per
suffix length, four ways (prefill copying past, prefill into the receive buffer, the two
sessions), the load printed, and the in-place logits bit-equal to the copying ones."""
from __future__ import annotations

import re


def test_decode_leg_rows_show_prefill_in_place_beside_copying_and_agree(capsys):
    from bench.engine import main
    assert main(["--shape", "tiny", "--decode-leg-only", "--cached", "64", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill into the receive buffer (now)" in out and "prefill, past copied (before)" in out
    assert len(re.findall(r"^load average [\d.]+ [\d.]+ [\d.]+", out, re.M)) == 2
    rows = re.findall(r"^\| (\d+) \| (?:[\d.]+ ms \| ){4}[\d.]+x \| [\d.]+x \| .*\(logits: prefill now, adopted, "
                      r"copied (bit-equal|differ)\)$", out, re.M)
    assert rows == [("1", "bit-equal"), ("4", "bit-equal"), ("8", "bit-equal")], out[-2000:]
