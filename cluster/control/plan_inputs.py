"""What the planner (:mod:`cluster.control.planner`) plans from, as frozen values: the rendered
request and its segments, a snapshot of what the tier holds, a session's last context, and the
planner's configuration (from the policy section and the model's fidelity profile)."""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.control.compose_choice import ComposeChoice, EditVerdict
from cluster.control.edit_choice import EditChoice
from cluster.control.edit_plan import HeldPromptEdit
from kvruntime.messages.plan import KVRef, PlanKind, Policy


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
