"""Plain prompts that ask for their own log-probs (``/v1/completions`` with ``echo`` and
``logprobs``, as vLLM's ``prompt_logprobs``): every prompt position's logits are needed, and KV
loaded from the tier or a decode engine's cache carries none, so such a request is planned as a
full recompute of its prefix on the prefill worker (no reuse of any kind), which keeps each row's
log-probs and returns them in its result (``prefill_workers.steps.PlanBuild``); the decode engine
is never let compute the rest itself (``RequestRunner.grant``). The prefix KV built is stored as
any plain prompt's, so a later request without log-probs reuses it. Counted:
``kvnotes_reuse_miss_total{reason="prompt_logprobs"}`` (the prefix tokens computed for it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvruntime.messages.plan import PlanKind, RequestPlan, SegmentPlan

if TYPE_CHECKING:
    from cluster.control.metrics import Metrics
    from cluster.control.planner import RenderedRequest

REASON = "the prompt's log-probs were asked (echo + logprobs): every prompt token computed, nothing reused"


def scored_plan(req: "RenderedRequest", k: int, metrics: "Metrics") -> RequestPlan:
    """The plan of a plain prompt (``Renderer.render_prompt``'s ``req``: one prompt segment, the
    last token the suffix) whose prompt log-probs (top ``k``) are asked: one recompute step of the
    prefix from position 0. A one-token prompt has no prefix and no log-prob to compute."""
    prefix = tuple(req.context[0].token_ids) if req.context else ()
    if not prefix:
        return RequestPlan(req.request_id, req.model, req.policy, (), tuple(req.suffix_ids))
    step = SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=prefix, position=0,
                       computed=len(prefix), reused=0, reason=REASON)
    metrics.reuse_misses.labels("prompt_logprobs").inc(len(prefix))
    return RequestPlan(req.request_id, req.model, req.policy, (step,), tuple(req.suffix_ids), notes=(REASON,),
                       prompt_logprobs=k)
