"""Structured outputs on the reference decode engine: a request's
:class:`~kvruntime.messages.decode.Constraint` compiled by xgrammar into a grammar over this
engine's tokenizer, a matcher per request, and the token bitmask it fills applied to every
step's logits before sampling (disallowed tokens get ``-inf``).

- :class:`GrammarCache`: one per decode engine (so per tokenizer); compiled grammars kept per
  (kind, schema, strict) in a bounded LRU (``grammar_cache_entries`` in config); compile
  seconds and hits / misses go to the process-wide Prometheus registry, which the decode
  actor's endpoint serves (``decode_workers.metrics``).
- :class:`Guide`: one request's matcher. ``mask(logits)`` before each pick, ``accept(token)``
  after; once the grammar is complete only the engine's stop tokens are allowed, so the
  answer ends with EOS (``finish_reason: stop``), or earlier at ``max_tokens`` (``length``).

JSON is generated without free whitespace (``any_whitespace=False``): small models otherwise
spend their budget on newlines. vLLM's engine takes the same constraint as its own
``StructuredOutputsParams`` (``decode_workers.vllm_engine``).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from kvruntime.messages.decode import Constraint

_METRICS = None


def _metrics():
    """(compile seconds histogram, cache lookups counter) in the process-wide registry, once."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Histogram
        _METRICS = (Histogram("kvnotes_grammar_compile_seconds", "Seconds to compile a structured-output grammar "
                              "(decode worker, reference engine)", ["kind"],
                              buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
                    Counter("kvnotes_grammar_cache_total", "Structured-output grammar cache lookups by result "
                            "(hit | miss)", ["result"]))
    return _METRICS


def grammar_of(c: Constraint):
    """The xgrammar :class:`Grammar` of a constraint, without a tokenizer (the router uses this to
    refuse a schema before any work; raises on an unsupported or malformed schema)."""
    import xgrammar as xgr
    if c.kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    return xgr.Grammar.from_json_schema(c.schema, any_whitespace=False, strict_mode=c.strict)


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, stop_ids, *, max_entries: int = 64):
        import xgrammar as xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size, self.max_entries = vocab_size, max_entries
        self._lru: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compiled(self, c: Constraint):
        """(compiled grammar, compile seconds; 0.0 on a cache hit)."""
        key = (c.kind, c.schema, c.strict)
        hist, lookups = _metrics()
        with self._lock:
            got = self._lru.get(key)
            if got is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                lookups.labels("hit").inc()
                return got, 0.0
        t = time.perf_counter()
        g = self.compiler.compile_grammar(grammar_of(c))
        dt = time.perf_counter() - t
        hist.labels(c.kind).observe(dt)
        lookups.labels("miss").inc()
        with self._lock:
            self.misses += 1
            self._lru[key] = g
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)
        return g, dt

    def guide(self, c: Constraint) -> "Guide":
        g, dt = self.compiled(c)
        guide = Guide(g, self.vocab_size)
        guide.compile_seconds = dt
        return guide


class Guide:
    """One request's grammar state."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.compile_seconds = 0.0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([vocab], float32, CPU) with every token the grammar forbids now at ``-inf``."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        x = logits.clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(x, self.bitmask, vocab_size=self.vocab_size)
        return x.squeeze(0)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the grammar (the mask allowed it)")

    def replay(self, tokens) -> None:
        """A continuation: the tokens another worker already streamed move the matcher on."""
        for t in tokens:
            self.accept(t)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()
