"""What kind of reuse a request's cached prompt tokens were: ``exact`` (KV bit for bit a full
prefill's: the prompt index, a held context, exact chunk reuse, the decode engine's own prefix
cache), ``composed`` (a chunk repositioned into this context, or an approximate context built by
an earlier request of the same recipe) or ``edited`` (a held prompt's KV edited in place, or
reused whole under an erratum). The split sums to ``usage.prompt_tokens_details.cached_tokens``
(every prompt token nobody computed for this request, ``metrics.CACHED_SOURCES``), so a client
sees whether its answer rests on approximate reuse; ``kvnotes_reused_tokens_total{kind}`` counts
the same, beside ``kvnotes_prompt_tokens_total{source="computed"}``."""
from __future__ import annotations

from kvruntime.messages.plan import PlanKind, RequestPlan

REUSE_KINDS = ("exact", "composed", "edited")


def planned_kinds(plan: RequestPlan) -> dict[str, int]:
    """The plan's tier-loaded tokens by kind of reuse."""
    out = dict.fromkeys(REUSE_KINDS, 0)
    steps = plan.steps
    for i, s in enumerate(steps):
        if s.kind is PlanKind.EDIT_IN_PLACE:
            out["edited"] += s.reused
        elif s.kind is PlanKind.REPOSITION:
            out["composed"] += s.reused
        elif s.kind is PlanKind.REUSE:
            corrected = i + 1 < len(steps) and steps[i + 1].kind is PlanKind.ERRATUM
            approx = s.kv is not None and not s.kv.exact
            out["edited" if corrected else "composed" if approx else "exact"] += s.reused
    return out


def reuse_split(plan: RequestPlan, sources: dict[str, int]) -> dict[str, int]:
    """The cached tokens of one finished request by kind (``sources``: ``Finished.sources``).
    Tokens the prefill worker loaded are split as planned (when a fallback loaded fewer, the
    exact ones first); those the decode engine held (the leading ones, under the plan's recipe salt,
    ``RequestPlan.kv_salt``) are exact up to the plan's first approximate step, past it of the
    plan's approximate kind."""
    loaded = sources.get("reused", 0) + sources.get("repositioned", 0)
    planned = planned_kinds(plan)
    out = dict.fromkeys(REUSE_KINDS, 0)
    for k in REUSE_KINDS:
        out[k] = min(planned[k], loaded)
        loaded -= out[k]
    out["composed"] += loaded                       # loaded beyond the plan (none expected): not exact
    # the decode engine's cache holds the prompt's leading tokens under the plan's salt: bit-exact
    # before the plan's first approximate step (nothing approximate is attended to there), after it
    # built by (or attending to) the approximate steps: of the plan's approximate kind
    held = sources.get("decode_cache", 0)
    first = min((s.position for s in plan.steps if s.approximate), default=None) if plan.approx else None
    exact = held if first is None else min(held, first)
    out["exact"] += exact
    out["edited" if planned["edited"] else "composed"] += held - exact
    return out


def usage_details(cached: int, split: dict[str, int]) -> dict[str, int]:
    """``usage.prompt_tokens_details``: ``cached_tokens`` and its split by kind."""
    return {"cached_tokens": cached, **{f"{k}_tokens": split.get(k, 0) for k in REUSE_KINDS}}
