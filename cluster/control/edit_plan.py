"""Edits in a plan: which policy may plan which edit operation (:func:`edit_gate`), and a prompt
found equal to a held one except one contiguous span (:class:`HeldPromptEdit`, from prompt
matching) planned as an edit of the held KV (:func:`plan_held_edit`). Pure: no Ray, no I/O; the
planner (:mod:`cluster.control.planner`) calls it.

A held prompt's edit, by policy and the request's ``edit_strategy``:

- ``edit_strategy: erratum`` (the caller asks for it: it changes the prompt the model reads) ->
  the held prompt's KV reused whole + a correction sentence appended (the measured wording,
  ``kvruntime.errata``, which needs the span's label and its old and new text), where the
  policy allows the erratum (``fast``; ``balanced`` when the profile's ``edit_answers`` row
  meets the answer target);
- otherwise edit-in-place of the held KV (the span recomputed in place, its length may change,
  + the top-K downstream tokens), where the policy allows it (same rule);
- otherwise (``exact``, a profile that does not approve it, a span with no new tokens): the
  exact prefix before the divergence reused (down to the tier's piece boundary: a held entry is
  served by prefixes of whole pieces) and the rest recomputed.
``explain`` cites the profile row or the policy either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.control.compose_choice import EditVerdict
from kvruntime.errata import DEFAULT_ERRATUM_STYLE, erratum_text
from kvruntime.messages.plan import FieldEdit, KVRef, PlanKind, Policy, SegmentPlan


@dataclass(frozen=True)
class HeldPromptEdit:
    """A prompt equal to one the tier holds except for one contiguous span (found by prompt
    matching): ``held.token_ids[:start]`` and the new prompt's first ``start`` tokens are equal,
    ``held.token_ids[held_end:]`` is the new prompt's tail after ``new_ids``. The planner turns it
    into an edit of the held KV (edit-in-place, the erratum on request) or an exact reuse of
    ``[0:start]`` and a recompute from the divergence. ``label`` / ``old_text`` / ``new_text``
    (the span's human name, e.g. the record key before it, and its old and new text) are needed
    only for an erratum: without them one is not planned, and the plan says so."""
    held: KVRef                                 # the held prompt's KV (position 0); held.token_ids = its tokens
    start: int                                  # first divergent token offset (equal in both before it)
    held_end: int                               # the held prompt realigns here (exclusive)
    new_ids: tuple[int, ...]                    # the new prompt's tokens replacing held.token_ids[start:held_end]
    where: str = ""                             # for explain: "message 2 (user), token 812"
    label: str = ""                             # erratum only: the span's human label ("order status")
    old_text: str = ""                          # erratum only: the held span's text
    new_text: str = ""                          # erratum only: the new span's text

    def __post_init__(self):
        n = len(self.held.token_ids)
        if not 0 <= self.start <= self.held_end <= n:
            raise ValueError(f"held prompt edit span [{self.start}:{self.held_end}] outside the held prompt's {n} tokens")
        if self.held.position != 0:
            raise ValueError(f"held prompt edit: the held KV must start at position 0, got {self.held.position}")

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        """The new prompt (as matched): held prefix + new span + held tail."""
        t = self.held.token_ids
        return t[:self.start] + tuple(self.new_ids) + t[self.held_end:]


def edit_gate(policy: Policy, kind: PlanKind, verdicts: tuple[EditVerdict, ...]) -> tuple[bool, str]:
    """May ``policy`` plan the edit operation ``kind``? ``exact``: never (an edit's KV is not a
    recompute's); ``fast``: always; ``balanced``: when the model's profile row meets the answer
    target (``verdicts``, :func:`cluster.control.compose_choice.choose_edits_by_answers`). The
    reason cites the row either way."""
    if policy is Policy.EXACT:
        return False, f"policy exact: {kind.value} is not bit-identical to a recompute"
    v = next((v for v in verdicts if v.kind is kind), None)
    if policy is Policy.FAST:       # not gated by the profile; its row said for the caller to weigh
        return True, "policy fast" + (f" (the profile does not gate it; {v.reason})" if v else "")
    if v is None:
        return False, f"balanced: no answer-level profile row for {kind.value} (section edit_answers)"
    return v.allowed, v.reason


def plan_held_edit(policy: Policy, strategy: str, ids: tuple[int, ...], he: HeldPromptEdit, *, top_k: int,
                   piece: int, verdicts: tuple[EditVerdict, ...], encode: Callable[[str], list[int]],
                   notes: list[str]) -> list[SegmentPlan]:
    """Steps building the context ``ids`` (the rendered context's tokens, starting with
    ``he.new_token_ids``: ValueError otherwise) from the held prompt ``he.held``. The tier serves a
    held prompt in whole pieces, so ``he.held`` may be its longest whole-piece prefix: the context
    past ``he.new_token_ids`` is then computed in context after the edit (an erratum needs the
    whole held prompt: with such a tail it is not planned)."""
    n = len(he.new_token_ids)
    if tuple(ids[:n]) != he.new_token_ids:
        raise ValueError(f"held prompt edit does not describe this prompt: it rebuilds {n} tokens that are not "
                         f"the first of the context's {len(ids)}")
    ids, tail = tuple(ids[:n]), tuple(ids[n:])
    steps = _edit_steps(policy, strategy, ids, he, top_k, piece, verdicts, encode, notes, bool(tail))
    if tail:
        steps.append(SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=tail, position=n,
                                 computed=len(tail), reused=0,
                                 reason="the prompt past the held KV's last whole tier piece, computed in context"))
    return steps


def _edit_steps(policy, strategy, ids, he: HeldPromptEdit, top_k, piece, verdicts, encode, notes: list[str],
                tail: bool) -> list[SegmentPlan]:
    if strategy not in ("auto", "erratum", "edit_in_place"):
        raise ValueError(f"edit_strategy must be auto, erratum or edit_in_place, got {strategy!r}")
    held = he.held
    at = he.where or f"token {he.start}"
    notes.append(f"first divergence from a held prompt ({len(held.token_ids)} tokens, kv {held.digest}) at {at}: "
                 f"its tokens [{he.start}:{he.held_end}] replaced by {len(he.new_ids)} new ones, the rest equal")
    steps = _asked(policy, strategy, ids, he, top_k, verdicts, encode, notes, tail)
    steps = steps if steps is not None else _prefix_then_recompute(policy, ids, he, piece, notes)
    notes.append(f"edit_strategy {strategy} ({STRATEGY_MEANS[strategy]}): planned {_planned(steps)} "
                 f"under policy {policy.value}")
    return steps


# what each edit_strategy asks for (explain says it beside what was planned)
STRATEGY_MEANS = {"auto": "the default: edit-in-place where the policy allows it, the erratum only when asked",
                  "erratum": "asked by the caller: the held prompt + an appended correction",
                  "edit_in_place": "asked by the caller: the held prompt's KV edited in place"}


def _planned(steps: list[SegmentPlan]) -> str:
    kinds = {s.kind for s in steps}
    if PlanKind.ERRATUM in kinds:
        return "the erratum"
    if PlanKind.EDIT_IN_PLACE in kinds:
        return "edit-in-place"
    reused = sum(s.reused for s in steps)
    return f"the exact prefix ({reused} tokens) + a recompute from the divergence" if reused else "a recompute"


def _asked(policy, strategy, ids, he: HeldPromptEdit, top_k, verdicts, encode, notes: list[str],
           tail: bool) -> list[SegmentPlan] | None:
    """The edit the strategy asks for, where the policy allows it; None: recompute from the divergence."""
    if strategy == "erratum" and tail:
        notes.append("erratum requested, but the tier holds the held prompt only up to its last whole piece (the "
                     "correction must follow the whole of it): recomputed from the divergence")
        steps = None
    elif strategy == "erratum":
        steps = _erratum(policy, ids, he, verdicts, encode, notes)
    else:
        steps = _in_place(policy, ids, he, top_k, verdicts, notes)
    return steps


def _in_place(policy, ids, he: HeldPromptEdit, top_k: int, verdicts, notes: list[str]) -> list[SegmentPlan] | None:
    ok, why = edit_gate(policy, PlanKind.EDIT_IN_PLACE, verdicts)
    if not ok:
        notes.append(f"edit-in-place not planned ({why}): recomputed from the divergence")
        return None
    if not he.new_ids:
        notes.append("edit-in-place needs at least one new token (the span was deleted): recomputed from the "
                     "divergence")
        return None
    if policy is Policy.BALANCED and not he.held.exact:
        notes.append("edit-in-place under balanced edits exact KV only (the profile measured edits of exact notes); "
                     "the held prompt's KV is approximate: recomputed from the divergence")
        return None
    k = min(top_k, len(he.held.token_ids) - he.held_end)
    old = he.held_end - he.start
    return [SegmentPlan(kind=PlanKind.EDIT_IN_PLACE, source="prompt", token_ids=ids, position=0,
                        computed=len(he.new_ids) + k, reused=len(he.held.token_ids) - old - k, kv=he.held,
                        field_span=(he.start, he.held_end), top_k=k,
                        reason=f"the held prompt edited in place at {he.where or f'token {he.start}'}: {old} held "
                               f"token(s) replaced by {len(he.new_ids)} computed, + {k} downstream recomputed ({why})")]


def _erratum(policy, ids, he: HeldPromptEdit, verdicts, encode, notes: list[str]) -> list[SegmentPlan] | None:
    ok, why = edit_gate(policy, PlanKind.ERRATUM, verdicts)
    if not ok:
        notes.append(f"erratum requested but not planned ({why}): recomputed from the divergence")
        return None
    if not (he.label.strip() and he.new_text.strip()):
        notes.append("erratum requested but the changed span has no label and new text to word a correction "
                     "with (kvruntime.errata's measured wording needs both): recomputed from the divergence")
        return None
    held = he.held.token_ids
    text = erratum_text(he.label, he.new_text, old=he.old_text or None, style=DEFAULT_ERRATUM_STYLE)
    err = tuple(encode(text))
    notes.append(f"erratum requested: the model reads the held prompt ({len(held)} tokens) + the correction "
                 f"{text.strip()!r}, not this prompt (the request's tail after the span is the held one's)")
    return [SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=held, position=0, computed=0,
                        reused=len(held), kv=he.held, reason=f"the held prompt reused whole ({len(held)} tokens)"),
            SegmentPlan(kind=PlanKind.ERRATUM, source="erratum", token_ids=err, position=len(held), computed=len(err),
                        reused=0, edits=(FieldEdit("prompt", "span", he.label, he.old_text, he.new_text),),
                        reason=f"the changed span corrected by an appended erratum, requested by the caller ({why})")]


def _prefix_then_recompute(policy, ids, he: HeldPromptEdit, piece: int, notes: list[str]) -> list[SegmentPlan]:
    """The exact prefix before the divergence (whole tier pieces), then everything after computed."""
    held = he.held
    b = len(held.token_ids) if he.start == len(held.token_ids) else (he.start // piece) * piece
    if not held.exact or b == 0:
        why = ("the held prompt's KV is approximate" if not held.exact else
               f"the divergence at token {he.start} is inside the first {piece}-token piece of the held KV")
        notes.append(f"no exact prefix of the held prompt to reuse ({why}): computed whole")
        return [SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=ids, position=0, computed=len(ids),
                            reused=0, reason="computed in context")]
    pre = KVRef(held.token_ids[:b], 0, held.tenant_salt)
    steps = [SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=ids[:b], position=0, computed=0, reused=b,
                         kv=pre, reason=f"exact prefix of the held prompt up to the divergence ({b} tokens: whole "
                                        f"{piece}-token pieces before token {he.start})")]
    if b < len(ids):
        steps.append(SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=ids[b:], position=b,
                                 computed=len(ids) - b, reused=0, reason="computed from the divergence"))
    return steps
