"""The plan is a value: what the planner decides, what workers execute, what ``explain`` shows.

Workers carry a :class:`RequestPlan` out step by step and never re-plan (like vLLM's
``SchedulerOutput``). Token ids travel inside the plan, and every step that loads KV names it by
content (:class:`KVRef`), so an executor needs nothing else: no name map, no registry.
"""
from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass, field

from kvruntime.messages.keys import token_hash


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
    # reuse + the cheapest compose op whose measured profile answers like recompute (the answer
    # target in cluster.control.compose_choice, `balanced_*` in the policy config: accuracy drop
    # <= 2 points at a one-sided 95% bound, decision agreement >= 98%, top-1 >= 95%, r <= 10%,
    # on >= 30 cases); no op meeting it: chunks are recomputed
    BALANCED = "balanced"
    FAST = "fast"          # all kinds: reposition with seam repair and errata (a target only with fast_min_top1)


@dataclass(frozen=True)
class FieldEdit:
    template: str          # template name
    field: str             # placeholder name
    label: str             # human label used in the erratum sentence
    old: str
    new: str


@dataclass(frozen=True)
class KVRef:
    """KV in the tier, named by content. With the executing worker's model id, KV dtype and RoPE
    fingerprint it is exactly one :class:`~kvruntime.messages.keys.ChunkKey`."""
    token_ids: tuple[int, ...]     # tokens of the stored entry (edit-in-place: the old context)
    position: int                  # canonical position of its first slot (chunks: 1 after BOS; contexts: 0)
    tenant_salt: str               # keys.tenant_salt(tenant, cluster secret)
    approx: str = ""               # "" = exact KV; else the digest of the recipe that built it
    prefix: tuple[int, ...] | None = None  # tokens a chunk is compiled after; None = the anchor (BOS);
                                           # () = nothing: token_ids compiled from position 0 (frame + chunk)

    @property
    def exact(self) -> bool:
        return not self.approx

    @functools.cached_property      # a pass over the tokens, asked for many times per request; the fields are frozen
    def digest(self) -> str:
        """Short display id (listings, ``explain``); the tier key adds model, dtype and RoPE."""
        raw = f"{self.tenant_salt}|{self.position}|{self.approx or 'exact'}|{token_hash(self.token_ids)}"
        if self.prefix is not None:
            raw += f"|prefix:{token_hash(self.prefix)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class SegmentPlan:
    """One step of a plan, built by keyword only (``SegmentPlan(kind=..., source=..., ...)``):
    six of its fields are numbers or token tuples that read alike in a positional list."""
    kind: PlanKind
    source: str                    # "skill:NAME" | "memory:NAME" | "template:NAME" | "text" | "session:ID" | "prompt"
    token_ids: tuple[int, ...]     # tokens this step contributes to the context, in order
    position: int                  # RoPE position of the step's first token in the context
    computed: int                  # tokens that go through a forward pass in this step
    reused: int                    # tokens whose KV is loaded from the tier
    kv: KVRef | None = None        # reuse / reposition / edit-in-place: the KV to load
    seam_tokens: int = 0           # reposition: tokens recomputed at the chunk's start
    edits: tuple[FieldEdit, ...] = ()   # erratum / edit-in-place: the changed fields
    field_span: tuple[int, int] | None = None  # edit-in-place: old field's slots in the cached context
    top_k: int = 0                 # edit-in-place: downstream tokens recomputed
    recompute_ratio: float = 0.0   # reposition: share of the chunk's tokens selectively recomputed (ops.blend)
    reason: str = ""               # one line for `explain`
    probe: str = "kv1"             # reposition with r > 0: how the r tokens are picked (kvruntime.ops.probes:
                                   # "kv1" layer-1 K deviation; "q..." the question's attention)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def approximate(self) -> bool:
        """True if this step's KV is not bit-for-bit what a full prefill would give."""
        if self.kind is PlanKind.RECOMPUTE:
            return False
        if self.kind is PlanKind.REUSE:
            return self.kv is not None and not self.kv.exact
        return True


@dataclass(frozen=True)
class RequestPlan:
    request_id: str
    model: str
    policy: Policy
    steps: tuple[SegmentPlan, ...]     # prefix steps, executed in order by a prefill worker
    suffix_ids: tuple[int, ...]        # prefilled by the decode worker after the prefix
    session: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)  # planner remarks (fallbacks, limits)
    # k >= 0: the prefill worker returns each prompt token's log-prob + top k (completions echo +
    # logprobs, ``PrefillStats.prompt_logprobs``): every step a recompute, and the decode engine never
    # computes the rest itself (its rows would be missing)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.prompt_logprobs is not None and (
                not 0 <= self.prompt_logprobs <= 20 or any(s.kind is not PlanKind.RECOMPUTE for s in self.steps)
                or not self.suffix_ids):
            raise ValueError("a plan asking for the prompt's log-probs (0..20 top) computes every prefix step "
                             "(recompute only) and has a suffix")

    @property
    def kind(self) -> PlanKind:
        """The request's plan kind for metrics: its most approximate step."""
        kinds = {s.kind for s in self.steps}
        return max(kinds, key=_SEVERITY.index) if kinds else PlanKind.RECOMPUTE

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.steps for t in s.token_ids)

    @property
    def prefix_tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    @property
    def forward_from(self) -> int:
        """End of the last step that loads KV (reuse, reposition, edit-in-place): every prefix
        token from here on is a plain forward in context (recompute, erratum). A decode engine
        that already holds at least this many leading tokens (and at least one) computes the
        rest itself, exactly as a prefill worker would: see :func:`decode_computes_rest`."""
        end, pos = 0, 0
        for s in self.steps:
            pos += s.tokens
            if s.kind not in (PlanKind.RECOMPUTE, PlanKind.ERRATUM):
                end = pos
        return end

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + len(self.suffix_ids)

    @property
    def reused_tokens(self) -> int:
        return sum(s.reused for s in self.steps)

    @property
    def computed_tokens(self) -> int:
        return sum(s.computed for s in self.steps) + len(self.suffix_ids)

    @property
    def approx(self) -> str:
        """"" if the prefix KV this plan builds is exact (only recompute and exact reuse), else a
        digest of its approximate steps: the tag its stored KV carries (beside its token ids), so
        ``exact`` plans never read it and two recipes never share it. Only the approximate steps
        are named: KV of the same tokens built with the same approximate steps is the same whatever
        was recomputed or reused exactly around them, so a growing conversation's next turn, composed
        the same way, finds the previous turn's blocks in vLLM's prefix cache (the same
        ``kv_salt``). A question-probed selective recompute also depends on the suffix: named too."""
        if not any(s.approximate for s in self.steps):
            return ""
        if len(self.steps) == 1 and self.steps[0].kind is PlanKind.REUSE and self.steps[0].position == 0:
            return self.steps[0].kv.approx          # the stored context reused whole: the same bytes, its tag
        recipe = [(s.kind.value, s.position, s.tokens, s.seam_tokens, s.top_k, s.recompute_ratio, s.field_span,
                   s.kv.digest if s.kv else None, tuple((e.field, e.old, e.new) for e in s.edits), s.probe)
                  for s in self.steps if s.approximate]
        asks = any(s.approximate and s.recompute_ratio and s.probe.startswith("q") for s in self.steps)
        raw = f"{self.model}\0{recipe}" + (f"\0{token_hash(self.suffix_ids)}" if asks else "")
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def kv_salt(self, tenant_salt: str) -> str:
        """Salt for a decode engine's own prefix cache (vLLM ``cache_salt``). Exact KV is shared
        within a tenant; KV built by an approximate step is close to but not bit-equal with a full
        prefill of the same tokens, so it is shared only with plans of the same recipe."""
        raw = f"{tenant_salt}\0{self.model}\0{self.approx or 'exact'}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def explain(self) -> dict:
        """JSON-able description returned when a request asks ``"explain": true``."""
        return {
            "request_id": self.request_id, "model": self.model, "policy": self.policy.value,
            "kind": self.kind.value, "session": self.session, "exact": not self.approx,
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "steps": [{"kind": s.kind.value, "source": s.source, "tokens": s.tokens, "position": s.position,
                       "computed": s.computed, "reused": s.reused, "seam_tokens": s.seam_tokens,
                       "kv": s.kv.digest if s.kv else None,
                       "edits": [{"template": e.template, "field": e.field, "old": e.old, "new": e.new}
                                 for e in s.edits],
                       "top_k": s.top_k, "recompute_ratio": s.recompute_ratio, "reason": s.reason}
                      for s in self.steps],
            "suffix_tokens": len(self.suffix_ids), "notes": list(self.notes),
            **({"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}),
        }


def decode_computes_rest(held: int, computes_from: int | None) -> bool:
    """The one rule the router and the decode worker share: with ``held`` leading prefix tokens
    in the decode engine and ``computes_from`` (:attr:`RequestPlan.forward_from`; None: the
    request needs its prefix built by a prefill worker, e.g. to store a session's context), the
    prefill worker is skipped and the decode engine computes the rest of the prefix itself."""
    return computes_from is not None and held > 0 and held >= computes_from
