"""Receive a request's prefix KV, prefill the suffix, decode and stream tokens.

If the prefix KV cannot be received (checksum rejected, transfer timed out, never sent), the
configured policy decides: ``recompute`` the prefix from the plan's token ids (counted and
logged), or ``fail`` the request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from kvruntime.kv import KVCache
from kvruntime.ops import recompute
from kvtransport.blocks import BlockError, decode_block
from kvtransport.transport import KVTransport, TransferError

log = logging.getLogger(__name__)


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


class DecodeExecutor:
    def __init__(self, engine, transport: KVTransport, *, load_failure_policy: str = "recompute",
                 receive_timeout: float = 60.0):
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        self.engine, self.transport = engine, transport
        self.policy, self.receive_timeout = load_failure_policy, receive_timeout

    def _prefix(self, transfer_id: str | None, prefix_ids: tuple[int, ...], fallbacks: list[str]) -> KVCache:
        if not prefix_ids:
            return self.engine.empty_kv()
        if transfer_id is None:
            # the caller knows no block was sent and has already counted that fallback
            return recompute(self.engine, list(prefix_ids), logits=False).kv
        try:
            kv = decode_block(self.transport.receive(transfer_id, timeout=self.receive_timeout),
                              model=self.engine.spec.name, device=self.engine.device)
            if kv.token_ids.tolist() == list(prefix_ids):
                return kv
            reason = "kv_mismatch"
        except TransferError as exc:
            reason = f"kv_transfer_{exc.reason}"
        except BlockError:
            reason = "kv_block_invalid"
        fallbacks.append(reason)
        log.warning("prefix KV for %s unusable (%s); policy %s", transfer_id, reason, self.policy)
        if self.policy == "fail":
            raise RuntimeError(f"prefix KV unavailable ({reason}) and kv load failure policy is 'fail'")
        return recompute(self.engine, list(prefix_ids), logits=False).kv

    def generate(self, transfer_id: str | None, prefix_ids: tuple[int, ...], suffix_ids: tuple[int, ...],
                 sampling: SamplingParams, *, salt: str | None = None) -> Iterator[TokenEvent | DecodeSummary]:
        """Yields one :class:`TokenEvent` per generated token, then a :class:`DecodeSummary`.
        ``salt`` is ignored: this engine keeps no KV across requests."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the decode worker computes the last logits)")
        t = time.perf_counter()
        fallbacks: list[str] = []
        kv = self._prefix(transfer_id, prefix_ids, fallbacks)
        received = time.perf_counter() - t
        start = len(prefix_ids)
        out = self.engine.prefill(list(suffix_ids), torch.arange(start, start + len(suffix_ids)), kv, logits=True)
        kv = KVCache.cat([kv, out.kv])
        ids: list[int] = []
        text = ""
        finish = "length"
        for i, tok in enumerate(self.engine.generate(kv, out.logits, sampling.max_tokens, temperature=sampling.temperature,
                                                     top_p=sampling.top_p, seed=sampling.seed)):
            if tok in self.engine.eos_ids:
                finish = "stop"
                break
            ids.append(tok)
            full = self.engine.decode(ids)
            delta, text = full[len(text):], full
            yield TokenEvent(tok, delta, i)
            if sampling.stop and any(s in text for s in sampling.stop):
                finish = "stop"
                break
        n_prefix = 0 if fallbacks or transfer_id is None else len(prefix_ids)
        yield DecodeSummary(len(ids), finish, tuple(fallbacks), received, text, n_prefix, n_prefix)
