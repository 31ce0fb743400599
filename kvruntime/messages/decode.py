"""The router <-> decode worker boundary: what to sample, and what comes back per token."""
from __future__ import annotations

import math
from dataclasses import dataclass

SEED_MAX = (1 << 63) - 1           # seeds are 0..2^63-1 (what torch.Generator.manual_seed and vLLM accept)
MAX_TOP_LOGPROBS = 20
CONSTRAINT_KINDS = ("json_object", "json_schema")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the decode worker compiles it into a grammar and masks every step's
    logits with it (reference engine: ``decode_workers.structured``; vLLM: its own
    ``StructuredOutputsParams``). ``json_object``: any JSON object; ``json_schema``: an instance
    of ``schema`` (its compact JSON text, the grammar cache's key);
    ``strict``: no properties or items the schema does not name (OpenAI's ``strict: true``)."""
    kind: str
    schema: str = ""
    strict: bool = False

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}")
        if (self.kind == "json_schema") != bool(self.schema):
            raise ValueError("a json_schema constraint carries its schema (and only it does)")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None                      # the router sets a random one for unseeded sampled requests
    stop: tuple[str, ...] = ()                   # generation ends before the first of these; it is not returned
    presence_penalty: float = 0.0                # -2..2, subtracted once from each token already generated
    frequency_penalty: float = 0.0               # -2..2, subtracted per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, -100..100) added to its logit before sampling
    logprobs: int | None = None                  # None: off; k >= 0: the sampled token's log-prob + top k
    constraint: Constraint | None = None         # structured output: the grammar every token must follow
    prompt_logprobs: int | None = None           # None: off; k >= 0: each prompt token's log-prob + top k
                                                 # (completions echo + logprobs; the plan a full recompute)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in 0..{SEED_MAX}")
        for p in (self.presence_penalty, self.frequency_penalty):
            if not (math.isfinite(p) and -2 <= p <= 2):
                raise ValueError("presence_penalty and frequency_penalty must be in -2..2")
        if any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100) for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in -100..100")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError("constraint must be a Constraint")


@dataclass(frozen=True)
class Continuation:
    """A request resumed on another decode worker after its first one was lost mid-stream
    (``cluster.control.migration``): the new worker prefills the prompt plus ``tokens`` itself
    and goes on from step ``len(tokens)`` with the same :class:`SamplingParams` (same seed, same
    ``max_tokens``: the steps already taken count against it), so its events continue the stream:
    indices, penalties, the seeded draws and stop strings spanning the boundary are those of an
    undisturbed run (reference engine; vLLM: see ``decode_workers.vllm_engine``)."""
    tokens: tuple[int, ...]   # token ids already streamed to the client, in order (>= 1)
    text: str                 # the text already streamed (the concatenation of their events' text)

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("a continuation starts after at least one streamed token")


@dataclass(frozen=True)
class TokenLogprob:
    """One prompt token's log-prob given the tokens before it, and the ``k`` most likely tokens
    there (``SamplingParams.prompt_logprobs``): the model's raw log-softmax, as vLLM's
    ``prompt_logprobs``. A prompt's first token has none (nothing precedes it)."""
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), best first


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str                 # incremental text for this token ("" mid-character or while a stop string may start)
    index: int                # 0 = first token (TTFT)
    logprob: float | None = None                     # sampled token's log-prob (when SamplingParams.logprobs is set)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, log-prob) of the most likely tokens, best first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # a request's first event only: prompt tokens 1.. (when asked)


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
    engine: str = ""          # the decode actor incarnation that ran it ("decode-1@<boot>"; "" in process)


@dataclass(frozen=True)
class DecodeJob:
    """Router -> decode worker (``DecodeWorker.generate``): one request's decode."""
    request_id: str                    # the request's id, on every log line of the call
    transfer_id: str | None            # the prefix block to load (None: none was sent)
    prefix_ids: tuple[int, ...]        # the plan's prefix token ids
    suffix_ids: tuple[int, ...]        # the plan's suffix (the question), computed by the decode engine
    sampling: SamplingParams
    kv_salt: str                       # the plan's KV salt (held-prefix and prefix-cache key)
    computes_rest: bool = False        # ExpectReply.computes_rest: no block comes, the engine computes the rest
    cancel_key: str | None = None      # what ``DecodeWorker.cancel`` names to stop it
    continuation: Continuation | None = None   # resume a stream another worker started and lost

    @property
    def cancels(self) -> bool:
        return self.cancel_key is not None
