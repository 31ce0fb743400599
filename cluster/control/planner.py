"""The planner: a pure function (no Ray, no I/O) from a rendered request, a snapshot of what
the tier holds, the session's last context and the policy to a frozen :class:`RequestPlan`.

Rules (whole-context reuse first, :func:`_reuse_first`; then per segment, left to right;
docs/architecture.md walks a request through them):
- the longest exact prefix first, under every policy: a session's exact context unchanged, else the
  whole context held exactly in the tier (a session's too, before any edit of its context), else
  (per segment) the longest exact prefix held (the prompt index) when it covers more than the frame
  variant; then the rest by the rules below
- session context unchanged                    -> reuse it whole (an ``exact`` request only if that
  context KV is exact; a context whose template was re-registered is planned from scratch)
- session context with edited template fields  -> erratum or edit-in-place: ``fast`` always;
  ``balanced`` only an operation whose answer-level row in the profile (section ``edit_answers``)
  meets the answer target (``PlannerConfig.balanced_edits``), else recomputed with the row cited;
  ``exact`` never. Which one: the caller's ``edit_strategy``, else the model's fidelity table
  (:func:`choose_edit_kind`)
- a prompt equal to a held one except one span (``TierView.held_edit``, from prompt matching) ->
  edit-in-place of the held KV where the policy allows it (same rule), the erratum only when the
  request asks for it, else the exact prefix before the divergence + recompute
  (:mod:`cluster.control.edit_plan`)
- chat frame + the skill / memory right after it -> one exact reuse step from position 0 of the
  tier entry holding both (:func:`frame_variant`: frame + chunk compiled together, ``KVRef.prefix``
  = (), nothing before them), under every policy: no rotation, no seam, no frame forward pass; the
  KV of a recompute of frame + chunk, bit for bit. A variant the tier does not hold yet is
  compiled on first use by the prefill worker (counted) and stored; registration precompiles the
  default frame's variant (``Router.register_chunk``)
- later skills / memories                     -> reposition + seam + selective recompute of r of its
  tokens (``balanced``, ``fast``), with the cheapest (seam, r, probe) whose row in the model's
  measured fidelity profile meets the policy's target (:func:`choose_compose`: ``balanced`` by
  answers, section ``compose_answers``; ``fast`` by next-token rows when ``fast_min_top1`` is set);
  none meets it, or no profile: recompute. One the tier no longer holds is re-warmed first (compiled at its canonical
  position and stored back)
- plain prompt with a cached prefix            -> reuse the prefix (any policy; the first rule)
- everything else                              -> recompute
- nothing reusable at all, no session to store, and a decode engine that computes prompts
  itself (vLLM: ``PlannerConfig.decode_computes_cold``) -> no prefix step: the whole prompt goes
  to the decode engine as its suffix, so no prefill worker runs and no KV block travels (a cold
  prompt costs what it costs in plain vLLM). A recurring span the tier does not hold yet counts as
  nothing reusable here (:func:`_reuses_nothing`): compiling it in the build computes as many
  tokens, waits for the prefill worker and makes the plan approximate, so a prompt whose only
  "reuse" it is stays exact (the decode engine's prefix cache and the decode-held record keep it
  for the next turn) and the span is compiled in the background after the answer
"""
from __future__ import annotations

import math
from typing import Callable

from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from cluster.control.compose_choice import (  # noqa: F401  (re-exported: the planner's public names)
    EXECUTED_PROBE, PLANNED_COMPILE, ComposeChoice, EditVerdict, FidelityTarget, _pct, answer_criteria, choose_compose,
    choose_edits_by_answers, compose_op_key, executable_probe)
from cluster.control.edit_choice import EDIT_OPS, EditChoice, choose_edit_kind  # noqa: F401  (re-exported)
from cluster.control.edit_plan import HeldPromptEdit, edit_gate, plan_held_edit  # noqa: F401  (re-exported)
from cluster.control.plan_inputs import (  # noqa: F401  (re-exported)
    PlannerConfig, RenderedRequest, RenderedSegment, SessionContext, TierView)
from cluster.control.session_plan import plan_from_session


def plan_request(req: RenderedRequest, tier: TierView, session: SessionContext | None,
                 encode: Callable[[str], list[int]], config: PlannerConfig = PlannerConfig()) -> RequestPlan:
    """Plan ``req``. ``encode`` is the model's tokenizer (a pure function of text), needed only
    to size erratum text. Raises ``ValueError`` for an empty request."""
    if not req.context and not req.suffix_ids:
        raise ValueError("empty request: no segments to plan")
    notes: list[str] = []
    steps = _reuse_first(req, tier, session, encode, config, notes)
    if steps is not None:
        return RequestPlan(req.request_id, req.model, req.policy, tuple(steps), req.suffix_ids, req.session,
                           tuple(notes))
    steps = _plan_segments(req, tier, config, notes)
    pos = sum(s.tokens for s in steps)
    if config.decode_computes_cold and req.session is None and steps and all(_reuses_nothing(s) for s in steps):
        # nothing to reuse and nothing to keep for a next turn: the decode engine computes it all
        notes[:] = _cold_notes(steps, notes)
        notes.append(f"nothing reusable: the decode engine computes all {pos + len(req.suffix_ids)} prompt "
                     "tokens itself (no prefill, no KV transfer)")
        ids = tuple(t for s in steps for t in s.token_ids) + req.suffix_ids
        return RequestPlan(req.request_id, req.model, req.policy, (), ids, None, tuple(notes))
    return RequestPlan(req.request_id, req.model, req.policy, tuple(steps), req.suffix_ids, req.session, tuple(notes))


def _reuses_nothing(step: SegmentPlan) -> bool:
    """A step that takes nothing the tier holds: a recompute, or a recurring span the tier does
    not hold yet, which the build would compile on its own first (as many tokens computed as in
    context, and on the prefill worker)."""
    return step.kind is PlanKind.RECOMPUTE or (step.kind is PlanKind.REPOSITION and step.reused == 0
                                               and step.source.startswith("span:"))


def _cold_notes(steps: list[SegmentPlan], notes: list[str]) -> list[str]:
    """A cold plan's notes: a recurring span it held back is compiled in the background instead."""
    fresh = [s.source for s in steps if s.kind is PlanKind.REPOSITION]
    kept = [n for n in notes if not any(n.startswith(f"{f} is not in the tier") for f in fresh)]
    return kept + [f"{f} recurs but is not in the tier yet, and nothing else in the prompt is: not compiled in this "
                   "build (it would compute as many tokens, on the prefill worker, and splice approximate KV where "
                   "the exact prompt can be kept); compiled on its own in the background after the answer"
                   for f in fresh]


def _reuse_first(req: RenderedRequest, tier: TierView, session: SessionContext | None, encode,
                 config: PlannerConfig, notes: list[str]) -> list[SegmentPlan] | None:
    """Whole-context reuse before anything is composed, in this order: the session's context
    unchanged and exact; the whole context held exactly in the tier (under every policy, in a
    session too: an exact prefix beats an edit or a composition of the same tokens); the
    session's context edited; an approximate whole context this plan's recipe built before
    (outside sessions); a held prompt this one edits in one span (``tier.held_edit``). None:
    plan segment by segment."""
    sess_steps = plan_from_session(req, session, encode, config, notes) if session is not None else None
    if sess_steps is not None and len(sess_steps) == 1 and sess_steps[0].kind is PlanKind.REUSE \
            and sess_steps[0].kv.exact:
        return sess_steps
    held = _held_context(req, tier, session)
    if held is not None and held.kv.exact:
        if sess_steps is not None:
            notes.append("the session's context would be edited or reused approximately, but the whole context is "
                         "held exactly in the tier: reused instead")
        return [held]
    if sess_steps is not None:
        return sess_steps
    if held is not None:
        return [held]
    if tier.held_edit is not None and session is None and req.context:
        ids = tuple(t for seg in req.context for t in seg.token_ids)
        steps = plan_held_edit(req.policy, req.edit_strategy, ids, tier.held_edit,
                               top_k=config.edit.top_k or 16, piece=config.kv_piece_tokens,
                               verdicts=config.balanced_edits, encode=encode, notes=notes)
        if any(s.kind is not PlanKind.RECOMPUTE for s in steps):
            return steps
        # a declined edit diverging inside the held KV's first piece reuses nothing of it: planned by
        # the segment rules (the tier's exact prefix first; on vLLM, no prefill at all: its own prefix
        # cache serves the blocks before the divergence, as plain vLLM's would)
        notes.append("the held prompt's edit reuses nothing of it: planned by the plain rules")
    return None


def _held_context(req: RenderedRequest, tier: TierView, session: SessionContext | None) -> SegmentPlan | None:
    """The whole context as one reuse of KV the tier holds for exactly its tokens, when it does:
    an exact prefix is preferred to composing the segments again under every policy, in a session
    too; approximate KV only outside sessions, by a request of a policy that may read it (never
    ``exact``)."""
    ref = tier.held_context
    if ref is None or not req.context or ref.position != 0:
        return None
    if not ref.exact and (session is not None or req.session is not None or req.policy is Policy.EXACT):
        return None
    ids = tuple(t for seg in req.context for t in seg.token_ids)
    if ref.token_ids != ids:
        return None
    why = ("the exact context is held in the tier (an earlier request computed it): reused whole, not composed again"
           if ref.exact else "this plan's composed context is held in the tier (the same recipe built it before): reused whole")
    return SegmentPlan(kind=PlanKind.REUSE, source="context", token_ids=ids, position=0, computed=0,
                       reused=len(ids), kv=ref, reason=why)


def _plan_segments(req: RenderedRequest, tier: TierView, config: PlannerConfig, notes: list[str]) -> list[SegmentPlan]:
    """Segment by segment, the longest exact prefix first: a held exact prefix of the context
    (``tier.prompt_prefix_kv``: the prompt index) covering more tokens than the frame variant, or
    the variant the tier does not hold yet, is reused; the segment it ends inside is computed from
    there; the rest is planned by the segment rules."""
    hit = _exact_prefix_hit(req.context, tier)
    steps: list[SegmentPlan] = []
    if hit:
        ids = tuple(t for seg in req.context for t in seg.token_ids)
        only = len(req.context) == 1 and req.context[0].kind == "prompt"
        steps.append(SegmentPlan(kind=PlanKind.REUSE, source="prompt" if only else "prefix", token_ids=ids[:hit],
                                 position=0, computed=0, reused=hit, kv=tier.prompt_prefix_kv,
                                 reason=f"cached prompt prefix of {hit} tokens" if only else
                                 f"exact prefix of {hit} tokens held in the tier (the prompt index), reused first"))
    first = None if hit else first_after_frame(req.context)
    pos = 0
    for i, seg in enumerate(req.context):
        n = len(seg.token_ids)
        if pos + n <= hit or (first is not None and i < first):
            pass                                # inside the exact prefix, or the frame: in the first chunk's variant
        elif pos < hit:
            source = f"{seg.kind}:{seg.name}" if seg.name else seg.kind
            steps.append(SegmentPlan(kind=PlanKind.RECOMPUTE, source=source, token_ids=seg.token_ids[hit - pos:],
                                     position=hit, computed=pos + n - hit, reused=0,
                                     reason="prompt after the cached prefix" if seg.kind == "prompt" else
                                     "computed in context after the held exact prefix"))
        elif i == first:
            steps += _plan_frame_reuse(req.context, tier, notes)
        else:
            steps += _plan_segment(seg, pos, req.policy, tier, config, notes)
        pos += n
    return steps


def _exact_prefix_hit(context: tuple[RenderedSegment, ...], tier: TierView) -> int:
    """Tokens of the held exact prefix to reuse first (0: none, or the frame variant is longer
    and held)."""
    if tier.prompt_prefix_kv is None or tier.prompt_prefix_hit <= 0 or not context:
        return 0
    hit = min(tier.prompt_prefix_hit, sum(len(seg.token_ids) for seg in context))
    variant = frame_variant(context)
    if variant is not None and variant.digest in tier.chunk_keys and len(variant.token_ids) > hit:
        return 0
    return hit


def first_after_frame(context: tuple[RenderedSegment, ...]) -> int | None:
    """Index of the registered skill/memory that comes first after the model's chat frame (every
    segment before it is the frame; no frame segment: it opens the context), or None."""
    for i, seg in enumerate(context):
        if seg.kind in ("skill", "memory"):
            return i if seg.kv is not None and seg.kv.exact else None
        if seg.kind != "frame":
            return None
    return None


def frame_variant(context: tuple[RenderedSegment, ...]) -> KVRef | None:
    """Content address of the chat frame (every segment before the first chunk) and the first
    chunk after it, compiled together from position 0 (``prefix=()``: nothing before them, so
    its tier key differs from the chunk's own): one exact entry, the KV of a recompute of frame +
    chunk. None when no registered exact chunk comes right after the frame. The key covers the
    frame ids and the chunk ids (and, in the tier, model, dtype and RoPE): another system prompt
    is another variant. The router looks it up in the tier with the chunks' own refs."""
    i = first_after_frame(context)
    if i is None:
        return None
    ids = tuple(t for seg in context[:i + 1] for t in seg.token_ids)
    return KVRef(ids, 0, context[i].kv.tenant_salt, prefix=())


def _plan_frame_reuse(context: tuple[RenderedSegment, ...], tier: TierView, notes: list[str]) -> list[SegmentPlan]:
    """One REUSE step from position 0 covering the frame and the first chunk (``frame+skill:NAME``)."""
    i = first_after_frame(context)
    seg, ref = context[i], frame_variant(context)
    n, nf = len(ref.token_ids), len(ref.token_ids) - len(seg.token_ids)
    source = f"frame+{seg.kind}:{seg.name}" if nf else f"{seg.kind}:{seg.name}"
    what = f"chat frame ({nf} tokens) + {seg.kind}:{seg.name} compiled together" if nf else \
        f"{seg.kind}:{seg.name} compiled at position 0"
    if ref.digest in tier.chunk_keys:
        return [SegmentPlan(kind=PlanKind.REUSE, source=source, token_ids=ref.token_ids, position=0, computed=0,
                            reused=n, kv=ref,
                            reason=f"{what}: exact, reused from the tier (no frame forward pass, no rotation, "
                                   "no seam)")]
    notes.append(f"{source} is not in the tier yet: compiled on first use (one forward pass from position 0) "
                 "and stored")
    return [SegmentPlan(kind=PlanKind.REUSE, source=source, token_ids=ref.token_ids, position=0, computed=n, reused=0,
                        kv=ref,
                        reason=f"{what}: exact; this variant is compiled on first use and stored (no rotation, "
                               "no seam)")]


def _plan_segment(seg: RenderedSegment, pos: int, policy: Policy, tier: TierView, config: PlannerConfig,
                  notes: list[str]) -> list[SegmentPlan]:
    source = f"{seg.kind}:{seg.name}" if seg.name else seg.kind
    n = len(seg.token_ids)
    if seg.kind in ("skill", "memory", "span"):      # span: a recurring span compiled on its own (prompt matching)
        if seg.kv is None:
            return [SegmentPlan(kind=PlanKind.RECOMPUTE, source=source, token_ids=seg.token_ids, position=pos,
                                computed=n, reused=0, reason="not registered")]
        if policy is Policy.EXACT:
            return [SegmentPlan(kind=PlanKind.RECOMPUTE, source=source, token_ids=seg.token_ids, position=pos,
                                computed=n, reused=0,
                                reason="policy exact: a repositioned chunk is not bit-identical to recompute")]
        choice = config.compose_for(policy)
        if choice is not None and not choice.allowed:
            return [SegmentPlan(kind=PlanKind.RECOMPUTE, source=source, token_ids=seg.token_ids, position=pos,
                                computed=n, reused=0, reason=f"policy {policy.value}: {choice.reason}")]
        k = min(choice.seam_tokens if choice else config.seam_tokens, n)
        r = choice.recompute_ratio if choice else 0.0
        probe = choice.probe if choice and r else EXECUTED_PROBE
        why = f"; chosen because {choice.reason}" if choice else ""
        if seg.kv.digest not in tier.chunk_keys:       # a span: seen again, not compiled yet (recurring.py)
            what = "compiled on its own" if seg.kind == "span" else "re-warmed"
            notes.append(f"{source} is not in the tier: {what} (compiled and stored back) before use")
            return [SegmentPlan(kind=PlanKind.REPOSITION, source=source, token_ids=seg.token_ids, position=pos,
                                computed=n, reused=0, kv=seg.kv, seam_tokens=k, recompute_ratio=r, probe=probe,
                                reason=f"{'recurring span' if seg.kind == 'span' else 'evicted chunk'} {what}, "
                                       f"then moved to position {pos}{why}")]
        c = k + math.ceil(r * (n - k) - 1e-9)
        return [SegmentPlan(kind=PlanKind.REPOSITION, source=source, token_ids=seg.token_ids, position=pos,
                            computed=c, reused=n - c, kv=seg.kv, seam_tokens=k, recompute_ratio=r, probe=probe,
                            reason=f"precompiled chunk moved to position {pos}, {k} seam token(s)"
                                   + (f" + {r:.0%} selectively" + ("" if probe == EXECUTED_PROBE else
                                                                   f" (picked by the question, {probe})")
                                      if r else "") + f" recomputed{why}")]
    return [SegmentPlan(kind=PlanKind.RECOMPUTE, source=source, token_ids=seg.token_ids, position=pos, computed=n,
                        reused=0, reason="computed in context")]
