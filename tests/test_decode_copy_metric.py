"""The reference decode engine's copied KV bytes (``ReferenceEngine.copied_bytes``) on the decode
actor's Prometheus endpoint as ``kvnotes_decode_kv_copied_bytes`` (issue 47: 0 while every
received prefix is used in place)."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from decode_workers.metrics import worker_registry
from kvtransport.transfer.inbox import InboxStats


class _Receiver:
    def stats(self):
        return InboxStats(**{f: ({} if f == "refused" else 0) for f in InboxStats.__dataclass_fields__})


def _value(registry) -> float:
    line = next(x for x in generate_latest(registry).decode().splitlines()
                if x.startswith("kvnotes_decode_kv_copied_bytes_total{"))
    return float(line.rsplit(" ", 1)[1])


def test_copied_bytes_counter_reads_the_engine_at_each_scrape():
    engine = SimpleNamespace(copied_bytes=0)
    r = worker_registry(_Receiver(), "decode-0", None, lambda: engine.copied_bytes)
    assert _value(r) == 0
    engine.copied_bytes = 4096
    assert _value(r) == 4096


def test_no_copied_series_without_a_reference_engine():
    text = generate_latest(worker_registry(_Receiver(), "decode-0")).decode()
    assert "kvnotes_decode_kv_copied_bytes" not in text
