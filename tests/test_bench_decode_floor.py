"""The decode leg's byte floor rows (issue 47 item 4): ``bench.cluster_vs_vllm`` prints the composed
prompt against vLLM's exact hit plus its KV bytes at the measured copy rate and at the nominal
bandwidth; ``bench.decode_leg`` measures the copy rate. Recorded numbers, no servers."""
from bench.cluster_vs_vllm_report import floor_rows, markdown
from bench.decode_leg import copy_gbs
from tests.test_bench_cluster_vs_vllm import _run


def test_floor_rows_put_the_kv_bytes_at_both_rates_beside_the_exact_hit():
    r = _run()
    assert floor_rows(r) == []                                   # a run without a measured copy rate: no table
    r["device"] = {"copy_gbs": 2.0, "nominal_gbs": 10.0, "kv_bytes_per_token": 1000}
    rows = floor_rows(r)
    assert "copy measured at 2.0 GB/s; 10 GB/s nominal" in rows[1]
    # 4k: 4000 tokens x 1000 B = 4 MB: 0.002 s at 2 GB/s, 0.0004 s at 10; 0.5 / (0.4 + 0.002) = 1.24x
    assert "| 4000 | 4 MB | 0.002 s | 0.000 s | 0.000 s | 0.50 | 0.40 | 0.40 | 1.24x |" in rows
    # 8k: 7.99 MB; measured transfer 0.1 + receive 0.01 + load 0.015 (means over both records)
    assert "| 7990 | 8 MB | 0.004 s | 0.001 s | 0.125 s | 1.10 | 1.00 | 1.00 | 1.10x |" in rows
    assert "\n".join(rows) in markdown(r)
    r["device"]["nominal_gbs"] = None
    assert "nominal (not given: --nominal-gbs)" in floor_rows(r)[1] and "| 4 MB | 0.002 s | - |" in floor_rows(r)[5]


def test_the_copy_rate_is_measured():
    assert 0.05 < copy_gbs(8 << 20) < 1000
