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
  prompt costs what it costs in plain vLLM)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from kvruntime.messages.plan import FieldEdit, KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from kvruntime.errata import erratum_text
from cluster.control.compose_choice import (  # noqa: F401  (re-exported: the planner's public names)
    EXECUTED_PROBE, PLANNED_COMPILE, ComposeChoice, EditVerdict, FidelityTarget, _pct, answer_criteria, choose_compose,
    choose_edits_by_answers, compose_op_key, executable_probe)
from cluster.control.edit_choice import EDIT_OPS, EditChoice, choose_edit_kind  # noqa: F401  (re-exported)
from cluster.control.edit_plan import HeldPromptEdit, edit_gate, plan_held_edit  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class RenderedSegment:
    kind: str                                   # "frame" | "skill" | "memory" | "template" | "text" | "prompt"
    name: str | None
    token_ids: tuple[int, ...]
    kv: KVRef | None = None                     # skill/memory: content address of the precompiled chunk
    fields: tuple[tuple[str, str], ...] = ()    # template: (field, value) in placeholder order
    field_spans: tuple[tuple[str, int, int], ...] = ()  # template: (field, start, end) offsets in token_ids
    labels: tuple[tuple[str, str], ...] = ()    # template: (field, human label for errata)
    version: str = ""                           # template: version of its text (a re-registration changes it)


@dataclass(frozen=True)
class RenderedRequest:
    request_id: str
    model: str
    policy: Policy
    context: tuple[RenderedSegment, ...]        # the prefix: frame + skills/memories/templates/text
    suffix_ids: tuple[int, ...]                 # the question + turn close: the decode worker prefills it
    session: str | None = None
    edit_strategy: str = "auto"                 # "auto" (fidelity table) | "erratum" | "edit_in_place"


@dataclass(frozen=True)
class TierView:
    """What the tier holds, as seen when planning (a snapshot, not a live handle)."""
    chunk_keys: frozenset[str] = frozenset()    # KVRef.digest of the precompiled chunks the tier holds
    prompt_prefix_hit: int = 0                  # plain prompts: tokens of the longest cached prefix
    prompt_prefix_kv: KVRef | None = None       # and its content address
    held_context: KVRef | None = None           # native requests: the whole context's KV, held at position 0
                                                # (exact, or built earlier by this very plan's recipe)
    held_edit: HeldPromptEdit | None = None     # plain prompts: a held prompt this one edits in one span


@dataclass(frozen=True)
class SessionContext:
    """A session's last cached context: the rendered segments it was built from and what was
    appended since (errata), so the next turn can reuse it whole."""
    session: str
    context: KVRef                              # the cached context KV (position 0; exact or approximate)
    segments: tuple[RenderedSegment, ...]       # as first rendered (original field values)
    token_ids: tuple[int, ...]                  # every token of the cached context (incl. errata)
    current_fields: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # template -> effective fields
    errata: int = 0                             # corrections appended so far


@dataclass(frozen=True)
class PlannerConfig:
    seam_tokens: int = 1                        # reposition: tokens recomputed at each chunk start (no choice given)
    edit: EditChoice = field(default_factory=lambda: EditChoice(PlanKind.ERRATUM, reason="default"))
    balanced: ComposeChoice | None = None       # per policy, from the profile; None: reposition + seam_tokens
    fast: ComposeChoice | None = None
    decode_computes_cold: bool = False          # True (decode engine vLLM): a plan reusing nothing skips prefill
    balanced_edits: tuple[EditVerdict, ...] = ()  # balanced: which edit operations the profile approves
                                                # (choose_edits_by_answers); none listed: edits recomputed
    kv_piece_tokens: int = 256                  # the tier serves a held entry's prefixes in whole pieces of this
                                                # many tokens (LMCache chunk_size)

    def compose_for(self, policy: Policy) -> ComposeChoice | None:
        return {Policy.BALANCED: self.balanced, Policy.FAST: self.fast}.get(policy)


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
    if config.decode_computes_cold and req.session is None and steps \
            and all(s.kind is PlanKind.RECOMPUTE for s in steps):
        # nothing to reuse and nothing to keep for a next turn: the decode engine computes it all
        notes.append(f"nothing reusable: the decode engine computes all {pos + len(req.suffix_ids)} prompt "
                     "tokens itself (no prefill, no KV transfer)")
        ids = tuple(t for s in steps for t in s.token_ids) + req.suffix_ids
        return RequestPlan(req.request_id, req.model, req.policy, (), ids, None, tuple(notes))
    return RequestPlan(req.request_id, req.model, req.policy, tuple(steps), req.suffix_ids, req.session, tuple(notes))


def _reuse_first(req: RenderedRequest, tier: TierView, session: SessionContext | None, encode,
                 config: PlannerConfig, notes: list[str]) -> list[SegmentPlan] | None:
    """Whole-context reuse before anything is composed, in this order: the session's context
    unchanged and exact; the whole context held exactly in the tier (under every policy, in a
    session too: an exact prefix beats an edit or a composition of the same tokens); the
    session's context edited; an approximate whole context this plan's recipe built before
    (outside sessions); a held prompt this one edits in one span (``tier.held_edit``). None:
    plan segment by segment."""
    sess_steps = _plan_from_session(req, session, encode, config, notes) if session is not None else None
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
        return plan_held_edit(req.policy, req.edit_strategy, ids, tier.held_edit,
                              top_k=config.edit.top_k or 16, piece=config.kv_piece_tokens,
                              verdicts=config.balanced_edits, encode=encode, notes=notes)
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


def _plan_from_session(req: RenderedRequest, sess: SessionContext, encode, config: PlannerConfig,
                       notes: list[str]) -> list[SegmentPlan] | None:
    """Steps reusing the session's cached context, or None if the context changed in a way
    only a recompute can honour (a different skill, text, or template)."""
    if len(req.context) != len(sess.segments):
        notes.append("session context has a different shape: planned from scratch")
        return None
    if req.policy is Policy.EXACT and not sess.context.exact:
        notes.append("session context KV was built by an approximate operation; policy exact: planned from scratch")
        return None
    current = {name: dict(fields) for name, fields in sess.current_fields}
    edits: list[FieldEdit] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for new, old in zip(req.context, sess.segments):
        if new.kind != old.kind or new.name != old.name:
            notes.append("session context has different segments: planned from scratch")
            return None
        if new.kind == "template" and new.version != old.version:
            notes.append(f"template {new.name!r} was re-registered since the session's context: planned from scratch")
            return None
        if new.kind == "template":
            now = current.get(new.name, dict(old.fields))
            for (f, v) in new.fields:
                if now.get(f) != v:
                    label = dict(new.labels).get(f, f.replace("_", " "))
                    edits.append(FieldEdit(new.name, f, label, now.get(f, ""), v))
                    s = dict((fs[0], fs[1:]) for fs in old.field_spans).get(f)
                    spans.append((offset + s[0], offset + s[1]) if s else (-1, -1))
        elif new.token_ids != old.token_ids:
            notes.append(f"session segment {new.kind}:{new.name} changed: planned from scratch")
            return None
        offset += len(old.token_ids)
    src = f"session:{sess.session}"
    ctx = sess.token_ids
    if not edits:
        return [SegmentPlan(kind=PlanKind.REUSE, source=src, token_ids=ctx, position=0, computed=0, reused=len(ctx),
                            kv=sess.context, reason=f"session context unchanged ({len(ctx)} tokens)")]
    one_span = len(edits) == 1 and spans[0][0] >= 0 and sess.errata == 0
    choice = _session_edit_choice(req, config, one_span, len(edits), notes)
    if choice is None:
        return None
    if choice.kind is PlanKind.EDIT_IN_PLACE and one_span:
        e = edits[0]
        new_ids = tuple(encode(e.new))
        return [SegmentPlan(kind=PlanKind.EDIT_IN_PLACE, source=src,
                            token_ids=ctx[:spans[0][0]] + new_ids + ctx[spans[0][1]:], position=0,
                            computed=len(new_ids) + choice.top_k,
                            reused=len(ctx) - (spans[0][1] - spans[0][0]) - choice.top_k, kv=sess.context, edits=(e,),
                            field_span=spans[0], top_k=choice.top_k,
                            reason=f"edit-in-place chosen by {choice.reason}")]
    text = "".join(erratum_text(e.label, e.new, old=e.old, style=choice.erratum_style) for e in edits)
    err_ids = tuple(encode(text))
    return [
        SegmentPlan(kind=PlanKind.REUSE, source=src, token_ids=ctx, position=0, computed=0, reused=len(ctx),
                    kv=sess.context, reason=f"old context reused whole ({len(ctx)} tokens)"),
        SegmentPlan(kind=PlanKind.ERRATUM, source="erratum", token_ids=err_ids, position=len(ctx),
                    computed=len(err_ids), reused=0, edits=tuple(edits),
                    reason=f"{len(edits)} field(s) corrected by an appended erratum ({choice.reason})"),
    ]


def _session_edit_choice(req: RenderedRequest, config: PlannerConfig, one_span: bool, n_edits: int,
                         notes: list[str]) -> EditChoice | None:
    """Which edit operation a session's changed fields get, or None (recomputed, with a note
    citing why): the caller's ``edit_strategy``, else the model's table (``config.edit``); the
    policy must allow it (:func:`~cluster.control.edit_plan.edit_gate`: ``exact`` never,
    ``fast`` always, ``balanced`` by the profile's answer-level edit rows); edit-in-place needs
    one edit on an uncorrected context, else the erratum is taken where it is allowed."""
    base = config.edit
    if req.edit_strategy == "erratum":
        choice = EditChoice(PlanKind.ERRATUM, erratum_style=base.erratum_style, reason="requested by the caller")
    elif req.edit_strategy == "edit_in_place":
        choice = EditChoice(PlanKind.EDIT_IN_PLACE, top_k=base.top_k or 16, reason="requested by the caller")
    elif req.edit_strategy != "auto":
        raise ValueError(f"edit_strategy must be auto, erratum or edit_in_place, got {req.edit_strategy!r}")
    else:
        choice = base
    kinds = [choice.kind] + ([] if req.edit_strategy != "auto" else
                             [k for k in (PlanKind.EDIT_IN_PLACE, PlanKind.ERRATUM) if k is not choice.kind])
    misses = []
    for kind in kinds:
        if kind is PlanKind.EDIT_IN_PLACE and not one_span:
            notes.append("edit-in-place needs exactly one edit on an uncorrected context: erratum instead")
            kind = PlanKind.ERRATUM
        ok, why = edit_gate(req.policy, kind, config.balanced_edits)
        if ok:
            if kind is choice.kind:
                return choice if req.policy is Policy.FAST else replace(choice, reason=f"{choice.reason}; {why}")
            return (EditChoice(kind, top_k=base.top_k or 16, reason=why) if kind is PlanKind.EDIT_IN_PLACE
                    else EditChoice(kind, erratum_style=base.erratum_style, reason=why))
        misses.append(f"{kind.value}: {why}")
    notes.append(f"{n_edits} field edit(s) under policy {req.policy.value}: recomputed ("
                 + "; ".join(dict.fromkeys(misses)) + ")")
    return None
