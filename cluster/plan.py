"""The plan is a value: what the planner decides, what workers execute, what ``explain`` shows.

Workers carry a :class:`RequestPlan` out step by step and never re-plan (like vLLM's
``SchedulerOutput``). Token ids travel inside the plan so an executor needs nothing else.
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field


class PlanKind(str, enum.Enum):
    REUSE = "reuse"                  # KV exists at exactly this position after exactly this prefix
    REPOSITION = "reposition"        # a precompiled chunk, re-rotated to its offset + seam repair
    ERRATUM = "erratum"              # old cached context reused whole + appended correction
    EDIT_IN_PLACE = "edit_in_place"  # field recomputed in place + top-K downstream tokens
    RECOMPUTE = "recompute"          # full prefill of the segment


# Order used to name a whole request's plan after its most approximate step (metrics label).
_SEVERITY = [PlanKind.RECOMPUTE, PlanKind.REUSE, PlanKind.REPOSITION, PlanKind.EDIT_IN_PLACE, PlanKind.ERRATUM]


class Policy(str, enum.Enum):
    EXACT = "exact"        # reuse only: output identical to recompute
    BALANCED = "balanced"  # reuse + reposition with seam repair
    FAST = "fast"          # all kinds


@dataclass(frozen=True)
class FieldEdit:
    template: str          # template name
    field: str             # placeholder name
    label: str             # human label used in the erratum sentence
    old: str
    new: str


@dataclass(frozen=True)
class SegmentPlan:
    kind: PlanKind
    source: str                    # "skill:NAME" | "memory:NAME" | "template:NAME" | "text" | "session:ID" | "prompt"
    token_ids: tuple[int, ...]     # tokens this step contributes to the context, in order
    position: int                  # RoPE position of the step's first token in the context
    computed: int                  # tokens that go through a forward pass in this step
    reused: int                    # tokens whose KV is loaded from the tier
    chunk_key: str | None = None   # tier key (reuse / reposition / session context)
    seam_tokens: int = 0           # reposition: tokens recomputed at the chunk's start
    edits: tuple[FieldEdit, ...] = ()   # erratum / edit-in-place: the changed fields
    field_span: tuple[int, int] | None = None  # edit-in-place: old field's slots in the cached context
    top_k: int = 0                 # edit-in-place: downstream tokens recomputed
    reason: str = ""               # one line for `explain`

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class RequestPlan:
    request_id: str
    model: str
    policy: Policy
    steps: tuple[SegmentPlan, ...]     # prefix steps, executed in order by a prefill worker
    suffix_ids: tuple[int, ...]        # prefilled by the decode worker after the prefix
    session: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)  # planner remarks (fallbacks, limits)

    @property
    def kind(self) -> PlanKind:
        """The request's plan kind for metrics: its most approximate step."""
        kinds = {s.kind for s in self.steps}
        return max(kinds, key=_SEVERITY.index) if kinds else PlanKind.RECOMPUTE

    @property
    def prefix_tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + len(self.suffix_ids)

    @property
    def reused_tokens(self) -> int:
        return sum(s.reused for s in self.steps)

    @property
    def computed_tokens(self) -> int:
        return sum(s.computed for s in self.steps) + len(self.suffix_ids)

    def kv_salt(self, tenant: str) -> str:
        """Salt for a decode engine's own prefix cache (vLLM ``cache_salt``). Exact KV (reuse and
        recompute steps only) is shared within a tenant; KV built by an approximate step
        (reposition, erratum, edit) is close to but not bit-equal with a full prefill of the same
        tokens, so it is shared only with requests built by the same recipe."""
        recipe = [(s.kind.value, s.source, s.position, s.tokens, s.seam_tokens, s.top_k, s.field_span,
                   tuple((e.field, e.old, e.new) for e in s.edits))
                  for s in self.steps if s.kind not in (PlanKind.REUSE, PlanKind.RECOMPUTE)]
        raw = f"{tenant}\0{self.model}\0{recipe if recipe else 'exact'}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def explain(self) -> dict:
        """JSON-able description returned when a request asks ``"explain": true``."""
        return {
            "request_id": self.request_id, "model": self.model, "policy": self.policy.value,
            "kind": self.kind.value, "session": self.session,
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "steps": [{"kind": s.kind.value, "source": s.source, "tokens": s.tokens, "position": s.position,
                       "computed": s.computed, "reused": s.reused, "seam_tokens": s.seam_tokens,
                       "edits": [{"template": e.template, "field": e.field, "old": e.old, "new": e.new}
                                 for e in s.edits],
                       "top_k": s.top_k, "reason": s.reason} for s in self.steps],
            "suffix_tokens": len(self.suffix_ids), "notes": list(self.notes),
        }
