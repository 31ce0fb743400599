"""Prometheus metrics (names from DESIGN.md section 7, ``kvnotes_`` prefix).

Workers do not export metrics themselves: every worker result carries its measurements
(tier hits, transfer bytes and seconds, fallbacks), and the router records them here, so one
``/metrics`` endpoint sees the whole request. Each :class:`Metrics` owns its own registry
(tests create several without clashing).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("kvnotes_ttft_seconds", "Time to first token, by plan kind", ["plan"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.requests = Counter("kvnotes_requests_total", "Requests by plan kind and status", ["plan", "status"],
                                registry=r)
        self.prompt_tokens = Counter("kvnotes_prompt_tokens_total",
                                     "Prompt tokens by where their KV came from", ["source"], registry=r)
        self.tier_hits = Counter("kvnotes_tier_hits_total", "KV tier lookups that hit", ["tier"], registry=r)
        self.tier_lookups = Counter("kvnotes_tier_lookups_total", "KV tier lookups", ["tier"], registry=r)
        self.transfer_bytes = Counter("kvnotes_kv_transfer_bytes_total", "KV bytes moved prefill -> decode",
                                      ["transport"], registry=r)
        self.transfer_seconds = Histogram("kvnotes_kv_transfer_seconds", "Seconds per KV block transfer",
                                          ["transport"], registry=r)
        self.fallbacks = Counter("kvnotes_fallbacks_total", "Fallbacks taken (each one also logged)", ["reason"],
                                 registry=r)
        self.fidelity_cosine = Histogram("kvnotes_fidelity_cosine", "Logit cosine vs recompute (shadow checks)",
                                         buckets=(0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0), registry=r)
        self.fidelity_kl = Histogram("kvnotes_fidelity_kl", "First-token KL(recompute || plan), shadow checks",
                                     ["plan", "op"], buckets=(0.001, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.fidelity_checks = Counter("kvnotes_fidelity_checks_total", "Shadow checks completed per operation",
                                       ["op"], registry=r)
        self.fidelity_agree = Counter("kvnotes_fidelity_agree_total", "Shadow checks agreeing with recompute, "
                                      "per operation and metric (top1, greedy16)", ["op", "metric"], registry=r)
        self.shadow_checks = Counter("kvnotes_shadow_checks_total", "Shadow checks by outcome "
                                     "(submitted, dropped: queue full, failed, done)", ["result"], registry=r)
        self.fidelity_demotions = Counter("kvnotes_fidelity_demotions_total", "Operations demoted / readmitted "
                                          "by online shadow checks", ["op", "event"], registry=r)
        self.rope_self_test = Gauge("kvnotes_rope_selftest_ok", "1 if the RoPE re-rotation self-test passed",
                                    ["worker"], registry=r)
        self.tier_rewarms = Counter("kvnotes_tier_rewarms_total",
                                    "Registered chunks missing from a worker's tier, recompiled and stored back",
                                    registry=r)
        self.registrations = Counter("kvnotes_registrations_total", "Skill/memory registrations by result",
                                     ["kind", "result"], registry=r)
        self.state_entries = Gauge("kvnotes_state_entries", "Entries in the state store (sessions and the prompt "
                                   "index are bounded by TTL and count)", ["kind"], registry=r)
        for src in ("reused", "repositioned", "erratum", "computed"):
            self.prompt_tokens.labels(src)  # export zeros so dashboards show the series from start

    def record_fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
