"""Prometheus metrics (``kvnotes_`` prefix; every name and label is listed in docs/observability.md).

Workers do not export metrics themselves: every worker result carries its measurements
(tier hits, transfer bytes and seconds, fallbacks), and the router records them here, so one
``/metrics`` endpoint sees the whole request. Each :class:`Metrics` owns its own registry
(tests create several without clashing).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.control.shadow import EXACT_OPS
from kvruntime.messages.decode import DecodeSummary
from kvruntime.messages.plan import PlanKind, RequestPlan
from kvruntime.messages.prefill import PrefillResult

if TYPE_CHECKING:
    from cluster.control.context import OutcomeRecord

PLAN_KINDS = tuple(k.value for k in PlanKind)

_STATUS_BY_CODE = {401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "too_large", 429: "rate_limited",
                   503: "unavailable", 504: "deadline"}


# Every fallback reason the code takes, exported as zeros from the start: a counter series that is
# born at 1 shows no increase to rate(), so the first fallback of a reason would be invisible to the
# dashboard and to KvnotesFallbackRateHigh. A reason missing here still counts, from its second on.
# (tier_remote_down is counted by the prefill actors, on their own exporters, not here.)
KNOWN_FALLBACKS = (
    "session_context_evicted", "prompt_prefix_evicted", "tier_lookup_worker_lost", "tier_store_failed",
    "prompt_index_unavailable", "decode_migrated",
    "kv_load_failed", "kv_mismatch", "kv_block_invalid", "kv_held_missing", "reposition_disabled",
    "kv_transport_nixl_unavailable", "kv_transport_nixl_to_grpc", "kv_send_pool_full", "kv_grpc_checksum_required",
    *(f"kv_transfer_{r}" for r in ("timeout", "rejected", "duplicate", "backpressure", "too_large", "unavailable",
                                   "unknown_peer", "unsupported", "unknown_transfer", "bad_credential",
                                   "wrong_model", "wrong_dtype", "wrong_length", "wrong_tokens")),
)


PROMPT_SOURCES = ("reused", "repositioned", "decode_cache", "erratum", "computed")
CACHED_SOURCES = ("reused", "repositioned", "decode_cache")     # nobody computed these: usage.cached_tokens


def prompt_sources(plan: RequestPlan, res: PrefillResult | None, summary: DecodeSummary) -> dict[str, int]:
    """A request's prompt tokens by where their KV came from (``kvnotes_prompt_tokens_total``),
    summing to ``plan.prompt_tokens``: ``reused`` / ``repositioned`` loaded from the tier by the
    prefill worker, ``decode_cache`` held by the decode engine (its held prefix or vLLM's prefix
    cache) and computed by nobody, ``erratum`` and ``computed`` through a forward pass somewhere
    (a token the prefill worker computed and the decode engine also held counts as computed)."""
    n = plan.prompt_tokens
    engine = min(summary.cached_tokens, n)        # prompt tokens the decode engine did not compute
    out = dict.fromkeys(PROMPT_SOURCES, 0)
    if res is None:                               # no prefill ran: the decode engine computed the rest
        out["decode_cache"] = engine
    elif res.transferred and not summary.fallbacks:
        # the prefill worker built every prefix token (loaded or computed): held ones it built
        # anyway are not cached; only suffix tokens the engine's cache held are
        stats = res.stats
        # a chunk compiled in this very build (re-warmed, a recurring span's sighting) is repositioned
        # by the worker but was computed for this request: no more than the plan reused counts
        planned = sum(s.reused for s in plan.steps if s.kind is PlanKind.REPOSITION)
        out.update(reused=stats.reused, repositioned=min(stats.repositioned, planned), erratum=stats.erratum,
                   decode_cache=max(engine - plan.prefix_tokens, 0))
    else:
        # the block was lost: the decode engine recomputed what its cache did not hold; of its hit,
        # the tokens the prefill worker computed anyway are not cached (a lower bound: the
        # prefill worker reports how many it computed, not where)
        stats = res.stats
        out.update(erratum=stats.erratum, decode_cache=max(engine - stats.computed - stats.erratum, 0))
    out["computed"] = n - sum(out.values())
    return out


# status label -> outcome label of kvnotes_requests_total (anything else: error)
_OUTCOMES = {"ok": "ok", "shed": "shed", "deadline": "timed_out", "client_error": "rejected", "unauthorized": "rejected",
             "forbidden": "rejected", "not_found": "rejected", "too_large": "rejected", "rate_limited": "rejected"}
OUTCOMES = ("ok", "error", "rejected", "shed", "timed_out", "cancelled_before_first_token",
            "cancelled_after_first_token")


def outcome_of(status: str, record: "OutcomeRecord | None") -> str:
    """The ``outcome`` of a request counted with ``status``: ok, error (the server's), rejected (the
    caller's mistake or its in-flight limit), shed (refused at admission: cluster.control.admission),
    timed_out (its deadline passed), cancelled before / after its first token (the client left)."""
    if status == "cancelled":
        return record.cancel_outcome if record is not None else "cancelled_before_first_token"
    if record is not None and record.shed:
        return "shed"
    return _OUTCOMES.get(status, "error")


def status_label(code: int) -> str:
    """HTTP status -> the ``status`` label of ``kvnotes_requests_total``."""
    if 200 <= code < 300:
        return "ok"
    return _STATUS_BY_CODE.get(code, "client_error" if 400 <= code < 500 else "error")

SHED_REASONS = ("tenant_over_share", "queue_full", "deadline", "ttft_objective")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.tenant_labels: frozenset[str] = frozenset()     # config metrics_tenants
        self._request_series(self.registry)
        self._fidelity_series(self.registry)
        self._state_series(self.registry)
        self._admission_series(self.registry)
        self._export_zeros()

    def _request_series(self, r: CollectorRegistry) -> None:
        """Requests, prompt tokens by source, the KV path (tier, transfer, stages) and fallbacks."""
        self.ttft = Histogram("kvnotes_ttft_seconds", "Time to first token, by plan kind", ["plan"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.requests = Counter("kvnotes_requests_total", "Requests by the plan that executed, final status, "
                                "the first fallback taken, per tenant where configured, and outcome (ok, error, "
                                "rejected, shed, timed_out, cancelled_before_first_token, "
                                "cancelled_after_first_token): every request once",
                                ["plan", "status", "fallback", "tenant", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("kvnotes_prompt_tokens_total",
                                     "Prompt tokens by where their KV came from", ["source"], registry=r)
        self.reused_tokens = Counter("kvnotes_reused_tokens_total", "Prompt tokens nobody computed, by kind of "
                                     "reuse: exact, composed (repositioned chunks), edited (a held prompt's KV "
                                     "edited); usage.prompt_tokens_details splits the same way", ["kind"], registry=r)
        self.reuse_misses = Counter("kvnotes_reuse_miss_total", "Prompt tokens computed although prompt matching ran, "
                                    "by why they were not reused", ["reason"], registry=r)
        self.recurring_spans = Counter("kvnotes_recurring_spans_total", "Spans recurring across a tenant's prompts, "
                                       "compiled on their own, by outcome", ["outcome"], registry=r)
        self.prompt_stores = Counter("kvnotes_prompt_stores_total", "Plain prompts the decode engine computed "
                                     "itself, compiled into the tier in the background, by outcome "
                                     "(cluster.control.store_behind)", ["outcome"], registry=r)
        self.tier_hits = Counter("kvnotes_tier_hits_total", "KV tier lookups that hit", ["tier"], registry=r)
        self.tier_lookups = Counter("kvnotes_tier_lookups_total", "KV tier lookups", ["tier"], registry=r)
        self.transfer_bytes = Counter("kvnotes_kv_transfer_bytes_total", "KV bytes moved prefill -> decode",
                                      ["transport"], registry=r)
        self.transfer_seconds = Histogram("kvnotes_kv_transfer_seconds", "Seconds per KV block transfer",
                                          ["transport"], registry=r)
        self.stage_seconds = Histogram("kvnotes_stage_seconds", "Seconds per stage of a request's KV path (tier get, "
                                       "re-rotate, forward, serialise, transfer, receive, load, suffix forward, "
                                       "first token)", ["stage", "transport"], buckets=_STAGE_BUCKETS, registry=r)
        self.fallbacks = Counter("kvnotes_fallbacks_total", "Fallbacks taken (each one also logged)", ["reason"],
                                 registry=r)

    def _fidelity_series(self, r: CollectorRegistry) -> None:
        """Fidelity (shadow checks, demotions, the RoPE self-test) and chunk compiles."""
        self.fidelity_cosine = Histogram("kvnotes_fidelity_cosine", "Logit cosine vs recompute (shadow checks)",
                                         buckets=(0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0), registry=r)
        self.fidelity_kl = Histogram("kvnotes_fidelity_kl", "First-token KL(recompute || plan), shadow checks",
                                     ["plan", "op"], buckets=(0.001, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.fidelity_checks = Counter("kvnotes_fidelity_checks_total", "Shadow checks completed per operation",
                                       ["op"], registry=r)
        self.fidelity_agree = Counter("kvnotes_fidelity_agree_total", "Shadow checks agreeing with recompute, "
                                      "per operation and metric (top1, greedy16)", ["op", "metric"], registry=r)
        self.fidelity_exact_mismatch = Counter("kvnotes_fidelity_exact_mismatch_total", "Shadow checks of an "
                                               "operation claimed exact (frame-variant reuse) that disagreed with "
                                               "a full recompute on the first token or the greedy continuation: "
                                               "a bug, each one logged at ERROR", ["op"], registry=r)
        self.shadow_checks = Counter("kvnotes_shadow_checks_total", "Shadow checks by outcome "
                                     "(submitted, dropped: queue full, failed, done)", ["result"], registry=r)
        self.fidelity_demotions = Counter("kvnotes_fidelity_demotions_total", "Operations demoted / readmitted "
                                          "by online shadow checks", ["op", "event"], registry=r)
        self.rope_self_test = Gauge("kvnotes_rope_selftest_ok", "1 if the RoPE re-rotation self-test passed",
                                    ["worker"], registry=r)
        self.tier_rewarms = Counter("kvnotes_tier_rewarms_total",
                                    "Registered chunks missing from a worker's tier, recompiled and stored back",
                                    registry=r)
        self.chunk_variants = Counter("kvnotes_chunk_variants_compiled_total",
                                      "Chunks compiled after a request's frame (system prompt + user-turn opener) "
                                      "on first use, for exact reuse as the first chunk after it", registry=r)
        self.registration_cores = Counter("kvnotes_registration_cores_compiled_total",
                                          "Registered chunks compiled once more without their trailing whitespace "
                                          "tokens, as prompts paste them (prompt matching)", registry=r)

    def _state_series(self, r: CollectorRegistry) -> None:
        """Registrations, the state store, workers, retries, cancels, deadlines, constrained decoding."""
        self.registrations = Counter("kvnotes_registrations_total", "Skill/memory registrations by result",
                                     ["kind", "result"], registry=r)
        self.registrations_tier = Gauge("kvnotes_registered_chunks", "Registered skills and memories of every tenant "
                                        "by whether the tier held their KV when last looked up",
                                        ["kind", "in_tier"], registry=r)
        self.state_entries = Gauge("kvnotes_state_entries", "Entries in the state store (sessions and the prompt "
                                   "index are bounded by TTL and count)", ["kind"], registry=r)
        self.state_store_up = Gauge("kvnotes_state_store_up", "1 while this router replica reaches the state "
                                    "store (a ping every state_probe_s; a request's failed call marks it 0 at once)",
                                    registry=r)
        self.state_store_errors = Counter("kvnotes_state_store_errors_total", "State store calls that got no answer "
                                          "(down, unreachable, timed out), by operation; op=ping is the periodic "
                                          "probe", ["op"], registry=r)
        self.workers_alive = Gauge("kvnotes_workers_alive", "Worker actors this router replica sees alive, by role",
                                   ["role"], registry=r)
        self.retries = Counter("kvnotes_retries_total", "Requests retried on another worker, streams continued on "
                               "another decode worker (migrated), and mid-stream worker failures (reason says which; "
                               "each one also logged)", ["role", "reason"], registry=r)
        self.cancels = Counter("kvnotes_cancels_total", "Work the router told a worker to stop, by role and why "
                               "(deadline passed, client gone)", ["role", "reason"], registry=r)
        self.tier_remote_up = Gauge("kvnotes_tier_remote_up", "1 when every prefill worker reaches the remote (lm://) "
                                    "KV tier, 0 when one cannot (it recomputes meanwhile); absent without one",
                                    ["tier"], registry=r)
        self.deadlines = Counter("kvnotes_deadline_exceeded_total", "Requests cancelled because their deadline "
                                 "passed, by the stage they were in", ["stage"], registry=r)
        self.constrained = Counter("kvnotes_constrained_requests_total", "Requests decoded under a grammar or "
                                   "answered with tools, by kind (json_object, json_schema, tool_auto, tool_required, "
                                   "tool_named)", ["kind"], registry=r)
        self.schemas_rejected = Counter("kvnotes_schemas_rejected_total", "JSON schemas refused with a 400 "
                                        "(response_format or tool parameters)", registry=r)
        for kind in ("json_object", "json_schema", "tool_auto", "tool_required", "tool_named"):
            self.constrained.labels(kind)

    def _admission_series(self, r: CollectorRegistry) -> None:
        """Admission control (cluster.control.admission, cluster.control.exchange)."""
        self.shed = Counter("kvnotes_shed_total", "Generation requests refused at admission before any work, by "
                            "reason (tenant_over_share: 429; queue_full, deadline, ttft_objective: 503), each with "
                            "Retry-After",
                            ["reason"], registry=r)
        self.admission_depth = Gauge("kvnotes_admission_queue_depth", "Requests this router replica admitted that "
                                     "have not reached their first token", registry=r)
        self.admission_wait = Gauge("kvnotes_admission_predicted_wait_seconds", "Predicted queue wait of the next "
                                    "request at this router replica (queue depth x measured service interval)",
                                    registry=r)
        self.admission_interval = Gauge("kvnotes_admission_service_interval_seconds", "Measured seconds between "
                                        "first tokens while requests queue (EWMA): the inverse of this replica's "
                                        "service rate", registry=r)
        self.admission_ttft_budget = Gauge("kvnotes_admission_ttft_budget_seconds", "The TTFT this router replica "
                                           "admits up to (admission_ttft_factor x its unloaded TTFT p90; 0 while "
                                           "off or not yet measured)", registry=r)
        self.admission_slowdown = Gauge("kvnotes_admission_slowdown", "Measured first-token time over the TTFT "
                                        "objective's model prediction (p90 of the last 20; 1 = as fast as when "
                                        "idle)", registry=r)
        self.admission_exchanges = Counter("kvnotes_admission_exchanges_total", "Admission exchanges with the "
                                           "ledger prefill worker before a request is taken (cluster.control."
                                           "exchange), by result: ok, timeout, error, unavailable (the last heard "
                                           "queues decided)", ["result"], registry=r)
        for result in ("ok", "timeout", "error", "unavailable"):
            self.admission_exchanges.labels(result)
        self.admission_exchange_seconds = Histogram("kvnotes_admission_exchange_seconds", "Seconds an admission "
                                                    "exchange took (answered ones): what a request about to be "
                                                    "admitted waits before any work",
                                                    buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1.0), registry=r)
        self.admission_peer_queued = Gauge("kvnotes_admission_peer_queued", "Requests the other router replicas "
                                           "had queued when this one last heard (via the prefill workers' health "
                                           "answers)", registry=r)

    def _export_zeros(self) -> None:
        """Zeros for every known label set: a counter born at 1 shows no increase to rate(), so a first
        fallback, shed, retry or mismatch would be invisible to dashboards and alerts."""
        for reason in SHED_REASONS:
            self.shed.labels(reason)                # zeros: the first shed is an increase rate() sees
        for src in PROMPT_SOURCES:
            self.prompt_tokens.labels(src)  # export zeros so dashboards show the series from start
        for kind in ("exact", "composed", "edited"):
            self.reused_tokens.labels(kind)
        for reason in KNOWN_FALLBACKS:
            self.fallbacks.labels(reason)           # zeros: a first fallback is an increase rate() can see
        for plan in PLAN_KINDS:                     # same for every plan's first request and first TTFT
            self.ttft.labels(plan)
        self.set_tenant_labels(())
        for role in ("prefill", "decode"):
            for reason in ("lost_before_first_token", "lost_mid_stream", "retries_exhausted"):
                self.retries.labels(role, reason)   # zeros: "no retries" is a value, not a missing series
            for reason in ("deadline", "client_gone"):
                self.cancels.labels(role, reason)
        self.retries.labels("decode", "migrated")
        for op in EXACT_OPS:                        # zeros: the first mismatch is an increase the alert sees
            self.fidelity_exact_mismatch.labels(op)

    def set_tenant_labels(self, tenants) -> None:
        """Tenants with their own ``tenant`` label (config ``metrics_tenants``); their ok series and
        those of "other" and "none" start at zero."""
        self.tenant_labels = frozenset(tenants)
        for plan in PLAN_KINDS:
            for t in (*sorted(self.tenant_labels), "other", "none"):
                self.requests.labels(plan, "ok", "", t, "ok")

    def count_request(self, plan: str, status: str, fallback: str = "", *,
                      record: "OutcomeRecord | None" = None) -> None:
        """The one place a request's final status is counted; marks ``record`` (the request's
        :class:`~cluster.control.context.OutcomeRecord`) counted. The tenant label is the request's
        tenant only for those named in ``tenant_labels`` (config ``metrics_tenants``: bounded
        cardinality), "other" for the rest, "none" before authentication (or without a record)."""
        tenant = record.tenant if record is not None else None
        label = "none" if tenant is None else (tenant if tenant in self.tenant_labels else "other")
        self.requests.labels(plan, status, fallback, label, outcome_of(status, record)).inc()
        if record is not None:
            record.mark_counted()

    def record_fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
