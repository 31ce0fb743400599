"""The ``matching`` section: how the router matches a plain prompt's token ids past its exact
prefix (``cluster.control.prompt_match``): content-defined spans and anchors (:class:`SpanConfig`,
``spans``), the smallest chunk worth splicing, when a recurring span is compiled on its own, when
a prompt is an edit of a held one, and how many fingerprints and held prompts the state store
keeps. Flat keys in a config file carry a ``matching_`` prefix (``matching_min_chunk_tokens`` ->
``matching.min_chunk_tokens``; ``matching_spans: {window: 16, ...}``). The one ``MatchConfig``:
the router's matcher receives this value as it is (``cluster.control.matching`` re-exports it)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class SpanConfig:
    """How prompts are cut (every replica and every stored fingerprint must agree: changing
    these makes the stored fingerprints unmatchable until they age out)."""
    window: int = 16            # token ids in the rolling hash
    min_span: int = 32          # a span is at least this long (but the prompt's last one)
    max_span: int = 256         # and at most this long
    boundary_bits: int = 6      # a candidate boundary every 2**bits tokens on average
    anchor_bits: int = 5        # an anchor every 2**bits tokens on average

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"matching.spans.{f.name} must be an integer, got {v!r}")
        if not 2 <= self.window <= 64:
            raise ValueError(f"matching.spans.window must be in [2, 64] tokens, got {self.window}")
        if not self.window <= self.min_span <= self.max_span:
            raise ValueError(f"matching.spans: need window <= min_span <= max_span, got {self.window}, "
                             f"{self.min_span}, {self.max_span}")
        if not (1 <= self.boundary_bits <= 16 and 1 <= self.anchor_bits <= 16):
            raise ValueError("matching.spans.boundary_bits and anchor_bits must be in [1, 16]")


_INTS = ("min_chunk_tokens", "compile_after", "unit_label_tokens", "compiles_in_flight", "compile_queue",
         "trim_window", "edit_max_tokens", "fingerprint_max", "held_prompt_max")


@dataclass(frozen=True)
class MatchConfig:
    """Prompt matching (``matching`` in the cluster config)."""
    enabled: bool = True
    spans: SpanConfig = field(default_factory=SpanConfig)   # a mapping of SpanConfig's fields in a config file
    min_chunk_tokens: int = 32      # a matched chunk shorter than this is computed as text
    # a span seen in this many prompts (this one included) is compiled on its own: in the request
    # that sees it the compile_after-th time when the policy splices it there, else in the background.
    # 1: besides, a prompt's document-like units (blank-line-separated blocks of a message, a numbered
    # label left out: cluster.control.units) are compiled in the background on their first sighting
    # where the request's policy splices chunks (a recurring span then still at its 2nd sighting)
    compile_after: int = 1
    unit_label_tokens: int = 8      # a unit's numbered label ("[3] ", "Document 5:") is at most this long (0: kept)
    # background compiles (recurring runs, first-sighting units) at once per router replica, a compile
    # waiting in the background gate included (0: none, every one skipped_busy); more wait in a FIFO
    # queue of compile_queue, each started when a slot frees; a full queue: skipped_busy (counted)
    compiles_in_flight: int = 2
    compile_queue: int = 16
    trim_window: int = 32           # a recurring run's edges are cut back to a line break within this many tokens
    # a held prompt is edited when >= this share of the new prompt equals it and the divergent
    # span is at most this long on either side: a field's change, the kind of edit the fidelity
    # profile measured (a longer one is composed or recomputed, never edited)
    edit_min_share: float = 0.75
    edit_max_tokens: int = 64
    # what the state store keeps for matching (all tenants together, least recently used dropped first)
    fingerprint_ttl_s: float = 86400.0  # spans, anchors and where each span was last seen, unused this long: gone
    fingerprint_max: int = 200_000      # at most this many fingerprints
    held_prompt_ttl_s: float = 3600.0   # held prompts' token ids (edit detection), unused this long: gone
    held_prompt_max: int = 5_000        # at most this many held prompts (each up to a context of ids)

    def __post_init__(self):
        if isinstance(self.spans, dict):
            bad = sorted(set(self.spans) - {f.name for f in fields(SpanConfig)})
            if bad:
                raise ValueError(f"unknown key(s) in matching.spans: {', '.join(map(str, bad))}")
            object.__setattr__(self, "spans", SpanConfig(**self.spans))
        if not isinstance(self.spans, SpanConfig):
            raise ValueError(f"matching.spans must be a mapping of {[f.name for f in fields(SpanConfig)]}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"matching.enabled must be true or false, got {self.enabled!r}")
        for name in _INTS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"matching.{name} must be an integer, got {v!r}")
        for name, least in (("min_chunk_tokens", 1), ("compile_after", 1), ("unit_label_tokens", 0),
                            ("compiles_in_flight", 0), ("compile_queue", 0), ("trim_window", 0), ("edit_max_tokens", 1),
                            ("fingerprint_max", 1), ("held_prompt_max", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"matching.{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 < self.edit_min_share <= 1:
            raise ValueError(f"matching.edit_min_share must be in (0, 1], got {self.edit_min_share!r}")
        for name in ("fingerprint_ttl_s", "held_prompt_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"matching.{name} must be > 0 seconds, got {getattr(self, name)!r}")

    @property
    def span_after(self) -> int:
        """Sightings before a recurring span (a run two prompts share) is compiled: at least 2."""
        return max(2, self.compile_after)

    @property
    def units_first_sighting(self) -> bool:
        """Document-like units compiled on their first sighting (``compile_after`` 1)."""
        return self.compile_after == 1

    def store_limits(self) -> dict:
        """The state store's bounds on matching, as ``cluster.control.state.StoreLimits`` keywords."""
        return {"fingerprint_ttl_s": self.fingerprint_ttl_s, "fingerprint_max": self.fingerprint_max,
                "held_prompt_ttl_s": self.held_prompt_ttl_s, "held_prompt_max": self.held_prompt_max}
