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
        expired = CounterMetricFamily("kvnotes_inbox_expired", "Received blocks or grants that expired unclaimed",
                                      labels=["worker", "what"])
        expired.add_metric([w, "block"], s.expired)
        expired.add_metric([w, "grant"], s.grants_expired)
        yield expired


class _ProcessRegistry:
    """The process-wide registry's series (vLLM's engine metrics register there), forwarded."""

    def collect(self):
        from prometheus_client import REGISTRY
        yield from REGISTRY.collect()


def worker_registry(receiver, worker: str):
    """This actor's registry: its inbox plus whatever the process-wide registry holds."""
    from prometheus_client import CollectorRegistry
    r = CollectorRegistry(auto_describe=False)
    r.register(InboxCollector(receiver, worker))
    r.register(_ProcessRegistry())
    return r
