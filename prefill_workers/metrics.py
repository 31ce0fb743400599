"""What a prefill actor exports on its own endpoint (``kvruntime.telemetry``): the plans it stopped on a
cancel (``kvnotes_worker_prefill_cancelled_total``) and its tier's counters,
read from the store at scrape time, so a scrape always sees the live values and nothing is
double counted with the router's series (the router counts plan-time lookups, ``kvnotes_tier_*``;
these are the worker's own gets, puts, evictions and remote-tier errors).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class TierCollector:
    """``kvnotes_worker_tier_*`` series of one prefill actor's store (labels: ``worker``)."""

    def __init__(self, store, worker: str, remote_configured: bool, cancelled=None, variants=None):
        self.store, self.worker, self.remote = store, worker, remote_configured
        self.cancelled = cancelled            # () -> plans this worker stopped on a cancel
        self.variants = variants              # () -> chunk variants compiled after a frame (PrefillTier)

    def collect(self):
        s, w = self.store.stats, self.worker
        if self.cancelled is not None:
            c = CounterMetricFamily("kvnotes_worker_prefill_cancelled", "Plans this prefill worker stopped before "
                                    "the end because the router cancelled them (deadline passed, client gone)",
                                    labels=["worker"])
            c.add_metric([w], self.cancelled())
            yield c
        if self.variants is not None:
            v = CounterMetricFamily("kvnotes_worker_chunk_variants_compiled", "Chunks this worker compiled after a "
                                    "frame (system prompt + user-turn opener) for exact reuse: a frame's first use "
                                    "of a chunk, or after its eviction", labels=["worker"])
            v.add_metric([w], self.variants())
            yield v
        from kvruntime import staging
        st = CounterMetricFamily("kvnotes_worker_kv_staged", "KV tensors this process moved to host memory for the "
                                 "tier or the transport, by path: cpu (engine on the CPU: no copy), pinned (from the "
                                 "GPU through page-locked memory), pageable_fallback (pinning refused)",
                                 labels=["worker", "path"])
        for path in ("cpu", "pinned", "pageable_fallback"):
            st.add_metric([w, path], staging.counts[path])
        yield st
        gets = CounterMetricFamily("kvnotes_worker_tier_gets", "Chunk gets on this worker's tier by result "
                                   "(hit per tier, miss per reason)", labels=["worker", "result", "tier"])
        for tier, n in sorted(s.hits_by_tier.items()):
            gets.add_metric([w, "hit", tier], n)
        for reason, n in sorted(s.misses.items()):
            gets.add_metric([w, f"miss_{reason}", ""], n)
        yield gets
        b = CounterMetricFamily("kvnotes_worker_tier_bytes", "KV bytes stored into / read from this worker's tier",
                                labels=["worker", "direction"])
        b.add_metric([w, "put"], s.put_bytes)
        b.add_metric([w, "get"], s.get_bytes)
        yield b
        occ = GaugeMetricFamily("kvnotes_tier_bytes", "KV bytes this worker's local tiers hold now",
                                labels=["worker", "tier"])
        for tier, n in sorted(self.store.occupancy().items()):
            occ.add_metric([w, tier], n)
        yield occ
        ev = CounterMetricFamily("kvnotes_worker_tier_evictions", "Chunks evicted from this worker's tier "
                                 "(by request)", labels=["worker"])
        ev.add_metric([w], s.evictions)
        yield ev
        pf = CounterMetricFamily("kvnotes_worker_tier_put_failures", "Puts a tier did not confirm",
                                 labels=["worker", "tier"])
        for tier, n in sorted(s.put_tier_failures.items()):
            pf.add_metric([w, tier], n)
        yield pf
        if self.remote:
            up = GaugeMetricFamily("kvnotes_tier_remote_up", "1 when this process reaches the remote KV tier "
                                   "(its last probe or operation succeeded; probed every tier_remote_probe_s)",
                                   labels=["worker"])
            up.add_metric([w], 1 if s.remote_up else 0)
            yield up
            err = CounterMetricFamily("kvnotes_worker_tier_remote_errors", "Failed or timed-out remote tier "
                                      "operations", labels=["worker"])
            err.add_metric([w], s.remote_errors)
            yield err
            ref = CounterMetricFamily("kvnotes_worker_tier_remote_auth_refusals", "Attaches or probes the "
                                      "tier server refused (this worker's tier key differs from the server's)",
                                      labels=["worker"])
            ref.add_metric([w], s.remote_auth_refusals)
            yield ref
            tls = CounterMetricFamily("kvnotes_worker_tier_remote_tls_handshakes", "TLS handshakes with the tier "
                                      "(tier_remote_tls_*: its tunnel and probes), by outcome", labels=["worker", "outcome"])
            tls.add_metric([w, "ok"], s.remote_tls_connections)
            tls.add_metric([w, "failed"], s.remote_tls_handshake_failures)
            yield tls
            # counted here, once, where the miss happened (not by every router replica that sees it)
            fb = CounterMetricFamily("kvnotes_fallbacks", "Fallbacks taken, by reason (a prefill worker's: "
                                     "lookups and gets that missed because the remote tier was down; the "
                                     "caller recomputes)", labels=["reason", "worker"])
            fb.add_metric(["tier_remote_down", w], s.remote_down_misses)
            yield fb


def worker_registry(store, worker: str, remote_configured: bool, cancelled=None, variants=None) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(TierCollector(store, worker, remote_configured, cancelled, variants))
    return r
