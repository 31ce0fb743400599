"""One vLLM request's outputs as kvnotes events: a :class:`TokenEvent` per token, then a
:class:`DecodeSummary` (what the load of its block did, from the connector's answer in
``RequestOutput.kv_transfer_params``)."""
from __future__ import annotations

import time
from typing import Iterator

from decode_workers.vllm_adapter import token_logprobs
from decode_workers.vllm_settings import PARAM_LOADED, PARAM_RESULT, PARAM_STAGES
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent


class DecodeStream:
    """The running totals of one request's stream (one thread: the ``generate`` caller's)."""

    def __init__(self, sampling: SamplingParams, stop_ids: frozenset[int], *, start: int = 0, text: str = ""):
        self.sampling, self.stop_ids = sampling, stop_ids
        self.n, self.text = start, text           # tokens and text so far (a continuation starts at its own)
        self.finish = "length"
        self.fallbacks: list[str] = []
        self.first: float | None = None           # seconds from submit to the first token
        self.cached = self.loaded = 0             # prompt tokens vLLM's prefix cache served / the connector wrote
        self.stages: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def events(self, out) -> Iterator[TokenEvent]:
        """The tokens of one delta output (stop tokens end the stream and are not emitted, as in
        the reference engine); the delta's text rides on its last token."""
        c = out.outputs[0]
        lps = list(c.logprobs or []) if self.sampling.logprobs is not None else []
        toks = [(t, lps[j] if j < len(lps) else None) for j, t in enumerate(c.token_ids) if t not in self.stop_ids]
        for j, (tok, lp) in enumerate(toks):
            if self.first is None:
                self.first = time.perf_counter() - self._t0
            yield TokenEvent(tok, c.text if j == len(toks) - 1 else "", self.n,
                             *token_logprobs(tok, lp, self.sampling.logprobs))
            self.n += 1
        self.text += c.text
        if out.num_cached_tokens is not None:
            self.cached = max(self.cached, out.num_cached_tokens)

    def close(self, out, *, expected_block: bool, policy: str) -> None:
        """Read the finished output: the connector's load outcome, the finish reason. A request
        vLLM ended with an error (policy ``fail``: its prefix KV could not be loaded) raises."""
        c = out.outputs[0]
        params = out.kv_transfer_params or {}
        result, self.loaded = params.get(PARAM_RESULT, ""), int(params.get(PARAM_LOADED, 0))
        self.stages = dict(params.get(PARAM_STAGES) or {})
        if result.startswith("failed:"):
            self.fallbacks.append(result.split(":", 1)[1])
        if c.finish_reason == "error":
            # policy 'fail': vLLM ends the request before the worker's reason reaches the
            # scheduler side (the connector logs it), so the label is generic
            reason = self.fallbacks[-1] if self.fallbacks else ("kv_load_failed" if expected_block else "engine error")
            raise RuntimeError(f"prefix KV unavailable ({reason}) and kv load failure policy is '{policy}'")
        self.finish = "stop" if c.finish_reason == "stop" else "length"

    def summary(self) -> DecodeSummary:
        stages = dict(self.stages)
        if self.first is not None:
            stages["first_token"] = self.first
        return DecodeSummary(self.n, self.finish, tuple(self.fallbacks), self.first or 0.0, self.text, self.cached,
                             self.loaded, tuple(stages.items()))
