"""What a decode actor exports on its own endpoint (``kvruntime.telemetry``): its KV inbox's
accounting, read at scrape time, and (registered in the process-wide registry it serves) vLLM's
own engine metrics when the engine is vLLM (``vllm:time_to_first_token_seconds``,
``vllm:prefix_cache_*``). The router's series count requests; these count the inbox.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class InboxCollector:
    """``kvnotes_inbox_*`` series of one decode actor's receiver (labels: ``worker``)."""

    def __init__(self, receiver, worker: str):
        self.receiver, self.worker = receiver, worker

    def collect(self):
        s, w = self.receiver.stats(), self.worker
        held = GaugeMetricFamily("kvnotes_inbox_held_bytes", "KV bytes received and not yet claimed",
                                 labels=["worker"])
        held.add_metric([w], s.held_bytes)
        yield held
        grants = GaugeMetricFamily("kvnotes_inbox_grants", "Announced transfers not yet received", labels=["worker"])
        grants.add_metric([w], s.grants)
        yield grants
        refused = CounterMetricFamily("kvnotes_inbox_refused", "Blocks refused by the inbox, by reason",
                                      labels=["worker", "reason"])
        for reason, n in sorted(s.refused.items()):
            refused.add_metric([w, reason], n)
        yield refused
        unchecked = CounterMetricFamily("kvnotes_inbox_unchecked_blocks", "Blocks accepted without a checksum "
                                        "(same-host gRPC pushes under checksum policy auto)", labels=["worker"])
        unchecked.add_metric([w], s.unchecked)
        yield unchecked
        roomless = CounterMetricFamily("kvnotes_inbox_roomless_blocks", "Blocks received plain: the granted room "
                                       "for the decode session did not fit (the session copies them)", labels=["worker"])
        roomless.add_metric([w], s.roomless)
        yield roomless
        expired = CounterMetricFamily("kvnotes_inbox_expired", "Received blocks or grants that expired unclaimed",
                                      labels=["worker", "what"])
        expired.add_metric([w, "block"], s.expired)
        expired.add_metric([w, "grant"], s.grants_expired)
        yield expired


class HeldCollector:
    """``kvnotes_decode_prefix_*`` series of the reference engine's held prefix KV
    (``decode_workers.held_kv``; labels: ``worker``)."""

    def __init__(self, held, worker: str):
        self.held, self.worker = held, worker

    def collect(self):
        s, w = self.held.stats(), self.worker
        g = GaugeMetricFamily("kvnotes_decode_prefix_held_bytes", "Prefix KV bytes the decode engine keeps for "
                              "later requests (decode_prefix_cache_bytes bounds it)", labels=["worker"])
        g.add_metric([w], s.held_bytes)
        yield g
        for name, doc, value in (
                ("kvnotes_decode_prefix_evictions", "Held prefix KV entries evicted (LRU, over "
                 "decode_prefix_cache_bytes)", s.evictions),
                ("kvnotes_decode_prefix_hit_tokens", "Prefix tokens not sent again because the decode engine "
                 "held their KV", s.hit_tokens),
                ("kvnotes_decode_prefix_copy_waits", "Held-prefix lookups that waited for a background copy of "
                 "their salt (made after a request's first token)", s.copy_waits),
                ("kvnotes_decode_prefix_copy_wait_timeouts", "Held-prefix lookups that gave up after copy_wait_s "
                 "and saw only what was already held", s.copy_wait_timeouts)):
            c = CounterMetricFamily(name, doc, labels=["worker"])
            c.add_metric([w], value)
            yield c


class CopiedCollector:
    """``kvnotes_decode_kv_copied_bytes``: KV bytes the reference decode engine copied
    (``ReferenceEngine.copied_bytes``: a received prefix without room, a held prefix into a
    session; 0 while every block lands in the buffer its suffix runs in, issue 47), read at scrape."""

    def __init__(self, copied, worker: str):
        self.copied, self.worker = copied, worker

    def collect(self):
        c = CounterMetricFamily("kvnotes_decode_kv_copied_bytes", "KV bytes the reference decode engine copied "
                                "into a new buffer (0 when received prefixes are used in place)", labels=["worker"])
        c.add_metric([self.worker], float(self.copied()))
        yield c


class _ProcessRegistry:
    """The process-wide registry's series (vLLM's engine metrics register there), forwarded."""

    def collect(self):
        from prometheus_client import REGISTRY
        yield from REGISTRY.collect()


def worker_registry(receiver, worker: str, held=None, copied=None):
    """This actor's registry: its inbox, its held prefix KV and copied KV bytes (reference engine:
    ``copied() -> int``), plus whatever the process-wide registry holds."""
    from prometheus_client import CollectorRegistry
    r = CollectorRegistry(auto_describe=False)
    r.register(InboxCollector(receiver, worker))
    if held is not None:
        r.register(HeldCollector(held, worker))
    if copied is not None:
        r.register(CopiedCollector(copied, worker))
    r.register(_ProcessRegistry())
    return r
