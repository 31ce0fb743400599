"""A session's next turn planned against its cached context (:func:`plan_from_session`, one rule
of :mod:`cluster.control.planner`): unchanged -> reused whole; edited template fields -> edit in
place or an appended erratum where the policy allows the operation (:func:`session_edit_choice`),
else recomputed with the reason noted; any other change -> planned from scratch."""
from __future__ import annotations

from dataclasses import replace

from cluster.control.edit_choice import EditChoice
from cluster.control.edit_plan import edit_gate
from cluster.control.plan_inputs import PlannerConfig, RenderedRequest, SessionContext
from kvruntime.errata import erratum_text
from kvruntime.messages.plan import FieldEdit, PlanKind, Policy, SegmentPlan


def plan_from_session(req: RenderedRequest, sess: SessionContext, encode, config: PlannerConfig,
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
    choice = session_edit_choice(req, config, one_span, len(edits), notes)
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


def session_edit_choice(req: RenderedRequest, config: PlannerConfig, one_span: bool, n_edits: int,
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
