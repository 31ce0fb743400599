"""Receive a request's prefix KV, prefill the suffix, decode and stream tokens.

If the prefix KV cannot be received (checksum rejected, transfer timed out, never sent), the
configured policy decides: ``recompute`` the prefix from the plan's token ids (counted and
logged), or ``fail`` the request.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

from kvruntime.decode_cache import DecodeSession
from kvruntime.kv import KVCache
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.ops import recompute
from decode_workers.sampling import Sampler, TextStream
from kvtransport.blocks import BlockError, decode_block
from kvtransport.transport import KVTransport, TransferError

log = logging.getLogger(__name__)


class DecodeExecutor:
    def __init__(self, engine, transport: KVTransport, *, load_failure_policy: str = "recompute",
                 receive_timeout: float = 60.0):
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        self.engine, self.transport = engine, transport
        self.policy, self.receive_timeout = load_failure_policy, receive_timeout

    def _prefix(self, transfer_id: str | None, prefix_ids: tuple[int, ...], fallbacks: list[str],
                stages: dict[str, float] | None = None) -> KVCache:
        stages = {} if stages is None else stages
        if not prefix_ids:
            return self.engine.empty_kv()
        if transfer_id is None:
            # the caller knows no block was sent and has already counted that fallback
            return recompute(self.engine, list(prefix_ids), logits=False).kv
        try:
            t = time.perf_counter()
            block = self.transport.receive(transfer_id, timeout=self.receive_timeout)
            stages["receive"] = time.perf_counter() - t
            kv = decode_block(block, model=self.engine.spec.name, device=self.engine.device)
            del block
            if kv.data.dtype != self.engine.dtype:
                kv = kv.to(self.engine.device, self.engine.dtype)
            stages["load"] = time.perf_counter() - t - stages["receive"]
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
        """Yields one :class:`TokenEvent` per generated token, then a :class:`DecodeSummary`. Text is
        detokenized incrementally (never half a character) and ends before a stop string.
        ``salt`` is ignored: this engine keeps no KV across requests."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the decode worker computes the last logits)")
        t = time.perf_counter()
        fallbacks: list[str] = []
        stages: dict[str, float] = {}
        kv = self._prefix(transfer_id, prefix_ids, fallbacks, stages)
        received = time.perf_counter() - t
        start = len(prefix_ids)
        t_suffix = time.perf_counter()
        # the context is copied once into a buffer with room for the suffix and every token to come
        session = DecodeSession(self.engine, kv, len(suffix_ids) + sampling.max_tokens)
        logits = session.step(suffix_ids, range(start, start + len(suffix_ids)))
        stages["suffix_forward"] = time.perf_counter() - t_suffix
        sampler = Sampler(sampling, logits.numel())
        stream = TextStream(self.engine.decode, sampling.stop)
        pos, n, finish = start + len(suffix_ids), 0, "length"
        while n < sampling.max_tokens:
            tok, lp, top = sampler.pick(logits)
            if tok in self.engine.eos_ids:
                finish = "stop"
                break
            n += 1
            if n == 1:
                stages["first_token"] = time.perf_counter() - t_suffix
            delta = stream.push(tok)
            if stream.stopped or n == sampling.max_tokens:
                delta += stream.finish()
            yield TokenEvent(tok, delta, n - 1, lp, top)
            if stream.stopped:
                finish = "stop"
                break
            if n < sampling.max_tokens:
                logits, pos = session.step([tok], [pos]), pos + 1
        stream.finish()       # after EOS: text still held back is in the summary's text, not in an event
        text = stream.text
        n_prefix = 0 if fallbacks or transfer_id is None else len(prefix_ids)
        yield DecodeSummary(n, finish, tuple(fallbacks), received, text, n_prefix, n_prefix, tuple(stages.items()))
