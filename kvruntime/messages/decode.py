"""The router <-> decode worker boundary: what to sample, and what comes back per token."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str                 # incremental text for this token (may be "" mid-character)
    index: int                # 0 = first token (TTFT)


@dataclass(frozen=True)
class DecodeSummary:
    completion_tokens: int
    finish_reason: str        # "stop" | "length"
    fallbacks: tuple[str, ...]
    receive_seconds: float    # reference: prefix receive time; vllm: add_request -> first token (receive inside)
    text: str
    cached_tokens: int = 0    # prompt tokens not computed by the decode engine (received + its own prefix cache)
    loaded_tokens: int = 0    # of those, prompt tokens whose KV arrived in the transferred block
    stages: tuple[tuple[str, float], ...] = ()   # KV path stage -> seconds on the decode side (transfer.STAGES)
