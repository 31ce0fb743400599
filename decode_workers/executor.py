"""Receive a request's prefix KV, prefill the suffix, decode and stream tokens.

If the prefix KV cannot be received (checksum rejected, transfer timed out, never sent), the
configured policy decides: ``recompute`` the prefix from the plan's token ids (counted and
logged), or ``fail`` the request.

With ``held`` (a :class:`~decode_workers.held_kv.HeldPrefixes`), the prefix KV of each request
is kept under its salt; :meth:`DecodeExecutor.held_prefix` / ``hold`` tell the actor how much of
the next prefix it need not be sent, and :meth:`DecodeExecutor._prefix` joins the held slots with
the received tail (which starts at the grant's ``first_position``). When that KV is the received
block as is (its memory a pool lease the transport reuses), the held copy is made in the
background once the first token has been yielded (:meth:`HeldPrefixes.put_copy`), not before it;
the summary reports its seconds as the ``held_copy`` stage.

The block is received into the buffer the suffix and the generated tokens are computed in: the
actor grants it room (``receive_room``: the suffix plus ``max_tokens`` slots after the block, and
the held slots before it), the transport writes the block's rows that far apart
(:class:`~kvtransport.transfer.blocks.SlotLayout`) and the :class:`DecodeSession` adopts that
buffer, so the received prefix is never copied (:attr:`DecodeExecutor.copied_bytes` counts the
prefix bytes sessions did copy: a plain block, a cast, a recompute).
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

import torch

from kvruntime.config.choices import LoadFailurePolicy
from kvruntime.decode_cache import DecodeSession
from kvruntime.kv import KVCache
from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent
from kvruntime.ops import recompute
from decode_workers.engine_api import DecodeEngine
from decode_workers.held_kv import HeldPrefixes
from decode_workers.sampling import Sampler, TextStream
from kvtransport.transfer.blocks import BlockError, block_buffer, decode_block
from kvtransport.transfer.interface import KVReceiver, TransferError

log = logging.getLogger(__name__)


class DecodeExecutor(DecodeEngine):
    """The reference decode engine (:class:`~decode_workers.engine_api.DecodeEngine`)."""
    kind = "reference"
    receive_room = True

    def __init__(self, engine, transport: KVReceiver, *,
                 load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE, receive_timeout: float = 60.0,
                 held: HeldPrefixes | None = None, grammar_cache_entries: int = 64):
        self.engine, self.transport = engine, transport
        self.policy, self.receive_timeout = LoadFailurePolicy.of(load_failure_policy), receive_timeout
        self.held = held
        self._grammars = None          # decode_workers.structured.GrammarCache, made on the first constrained request
        self.grammar_cache_entries = grammar_cache_entries
        self.copied_bytes = 0          # prefix KV bytes copied into decode sessions (0 for a block received with room)

    def held_prefix(self, prefix_ids: tuple[int, ...], salt: str | None = None, *,
                    transfer_id: str | None = None, limit: int | None = None,
                    computes_from: int | None = None) -> int:
        """Leading tokens of ``prefix_ids`` whose KV this executor holds under ``salt`` (0 without
        a held cache). With ``transfer_id``: at most ``limit`` of them are pinned for that
        transfer's :meth:`generate` (an eviction in between cannot take them); all of them when
        they reach ``computes_from`` (no block comes: :meth:`generate` with ``held_only``)."""
        if self.held is None:
            return 0
        if transfer_id is None:
            return self.held.held_prefix(prefix_ids, salt)
        return self.held.hold(transfer_id, prefix_ids, salt, len(prefix_ids) if limit is None else limit,
                              computes_from)

    def hold(self, grant, prefix_ids: tuple[int, ...], salt: str | None, computes_from: int | None = None) -> int:
        """Held leading tokens, pinned for ``grant``'s transfer: at most all but one unless they
        reach ``computes_from`` (the block, with its credential, stays the proof the prefill actor
        built this prefix, and the one receive path is kept)."""
        return self.held_prefix(tuple(prefix_ids), salt, transfer_id=grant.transfer_id, limit=grant.tokens - 1,
                                computes_from=computes_from)

    def _held_only(self, transfer_id: str, prefix_ids: tuple[int, ...], fallbacks: list[str],
                   stages: dict[str, float], room: int) -> tuple[KVCache, int, int, torch.Tensor | None]:
        """No block comes (``messages.plan.decode_computes_rest``): the KV pinned for this
        transfer at ``expect`` plus the rest of the prefix computed here, in context -- in one
        buffer with ``room`` more slots (the pinned KV copied into it once), adopted by the session."""
        pinned = self.held.take(transfer_id) if self.held is not None else None
        if pinned is None or pinned.token_ids.tolist() != list(prefix_ids[:pinned.num_tokens]):
            fallbacks.append("kv_held_missing")
            log.warning("held prefix KV for %s missing; policy %s", transfer_id, self.policy)
            if self.policy is LoadFailurePolicy.FAIL:
                raise RuntimeError("held prefix KV unavailable (kv_held_missing) and kv load failure policy is 'fail'")
            return recompute(self.engine, list(prefix_ids), logits=False).kv, 0, 0, None
        held, rest = pinned.num_tokens, list(prefix_ids[pinned.num_tokens:])
        if not rest:
            return pinned.to(self.engine.device, self.engine.dtype), 0, held, None
        t = time.perf_counter()
        session = DecodeSession(self.engine, pinned, len(rest) + room)   # the held KV stays held: copied
        self.copied_bytes += session.copied_bytes
        session.step(rest, range(held, len(prefix_ids)), logits=False)
        stages["forward"] = time.perf_counter() - t
        return session.kv, 0, held, session.data

    def _prefix(self, transfer_id: str | None, prefix_ids: tuple[int, ...], fallbacks: list[str],
                stages: dict[str, float] | None = None, held_only: bool = False,
                room: int = 0) -> tuple[KVCache, int, int, torch.Tensor | None]:
        """The prefix KV, how many of its tokens arrived in the transferred block, how many this
        engine did not compute (received or held), and the buffer the KV is the first slots of
        with ``room`` more (the block's receive buffer; None: the session copies the KV)."""
        stages = {} if stages is None else stages
        if not prefix_ids:
            return self.engine.empty_kv(), 0, 0, None
        if transfer_id is None:
            # the caller knows no block was sent and has already counted that fallback
            return recompute(self.engine, list(prefix_ids), logits=False).kv, 0, 0, None
        if held_only:
            return self._held_only(transfer_id, prefix_ids, fallbacks, stages, room)
        pinned = self.held.take(transfer_id) if self.held is not None else None
        try:
            t = time.perf_counter()
            block = self.transport.receive(transfer_id, timeout=self.receive_timeout)
            stages["receive"] = time.perf_counter() - t
            kv = decode_block(block, model=self.engine.spec.name, device=self.engine.device)
            buf = block_buffer(block) if self.engine.device.type == "cpu" else None   # the room it was received with
            lead = block.layout.lead if buf is not None else 0
            del block
            if kv.data.dtype != self.engine.dtype:
                kv, buf = kv.to(self.engine.device, self.engine.dtype), None
            start, loaded = len(prefix_ids) - kv.num_tokens, kv.num_tokens
            if start > 0:                   # the grant was narrowed: the first `start` slots are held here
                first = int(kv.positions[0]) if kv.num_tokens else start
                if pinned is None or pinned.num_tokens != start or first != start:
                    raise _Unusable("kv_held_missing")
                kv, buf = _join(pinned.to(self.engine.device, self.engine.dtype), kv, buf if lead == start else None)
            stages["load"] = time.perf_counter() - t - stages["receive"]
            if start >= 0 and kv.token_ids.tolist() == list(prefix_ids):
                return kv, loaded, len(prefix_ids), buf
            reason = "kv_mismatch"
        except TransferError as exc:
            reason = f"kv_transfer_{exc.reason}"
        except BlockError:
            reason = "kv_block_invalid"
        except _Unusable as exc:
            reason = str(exc)
        fallbacks.append(reason)
        log.warning("prefix KV for %s unusable (%s); policy %s", transfer_id, reason, self.policy)
        if self.policy is LoadFailurePolicy.FAIL:
            raise RuntimeError(f"prefix KV unavailable ({reason}) and kv load failure policy is 'fail'")
        return recompute(self.engine, list(prefix_ids), logits=False).kv, 0, 0, None

    def _keep(self, prefix_ids: tuple[int, ...], salt: str | None, kv: KVCache, loaded: int, aliases: bool) -> bool:
        """Keep this request's prefix KV for the next one, when it owns its memory (a cat, a
        cast, a recompute). False: it aliases the received block's memory (transports reuse
        that) or the decode session's buffer (``aliases``), so a fresh copy is to be made, off
        the first token's path (:meth:`HeldPrefixes.put_copy`)."""
        if self.held is None or salt is None or not prefix_ids or kv.nbytes > self.held.capacity:
            return True
        if loaded == len(prefix_ids) or aliases:      # the received block as is, or the session's buffer
            return False
        self.held.put(prefix_ids, salt, kv)
        return True

    def generate(self, transfer_id: str | None, prefix_ids: tuple[int, ...], suffix_ids: tuple[int, ...],
                 sampling: SamplingParams, *, salt: str | None = None,
                 held_only: bool = False,
                 continuation: Continuation | None = None) -> Iterator[TokenEvent | DecodeSummary]:
        """Yields one :class:`TokenEvent` per generated token, then a :class:`DecodeSummary`. Text is
        detokenized incrementally (never half a character) and ends before a stop string.
        ``salt``: the key this request's prefix KV is kept under for the next request (with a
        held cache; see :meth:`held_prefix`). ``held_only``: no block comes for ``transfer_id``;
        the prefix is what was pinned for it plus the rest, computed here. ``continuation``: the
        request was started by another worker, which streamed ``continuation.tokens``; they are
        replayed here after the suffix, one decode step each (the lost worker's own arithmetic, so
        greedy output equals an undisturbed run), and decoding goes on from there (event indices, penalties,
        seeded draws, stop strings and ``max_tokens`` continue; the summary counts every token)."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the decode worker computes the last logits)")
        done = continuation.tokens if continuation is not None else ()
        stream = TextStream(self.engine.decode, sampling.stop)
        if continuation is not None:
            stream.resume(done, continuation.text)
            if stream.stopped or len(done) >= sampling.max_tokens:      # it had ended; only the summary was lost
                stream.finish()
                yield DecodeSummary(len(done), "stop" if stream.stopped else "length", (), 0.0, stream.text)
                return
        t = time.perf_counter()
        fallbacks: list[str] = []
        stages: dict[str, float] = {}
        room = len(suffix_ids) + sampling.max_tokens
        kv, loaded, not_computed, buf = self._prefix(transfer_id, prefix_ids, fallbacks, stages, held_only, room)
        received = time.perf_counter() - t
        # a held copy that must be made (the received block as is) waits until the first token is out
        pending = None if self._keep(prefix_ids, salt, kv, loaded, buf is not None) else kv
        copy = None
        try:
            start = len(prefix_ids)
            t_suffix = time.perf_counter()
            # the buffer the block was received into, with room for the suffix and every token to
            # come (else the context is copied once into a new one)
            session = DecodeSession(self.engine, kv, room, buffer=buf)
            self.copied_bytes += session.copied_bytes
            logits = session.step(suffix_ids, range(start, start + len(suffix_ids)))
            pos = start + len(suffix_ids)
            for tok in done:     # a continuation replays the streamed tokens one step each, as the lost worker
                logits, pos = session.step([tok], [pos]), pos + 1     # computed them: the same logits after
            stages["suffix_forward"] = time.perf_counter() - t_suffix
            sampler = Sampler(sampling, logits.numel(), history=done, guide=self._guide(sampling, logits.numel(), done,
                                                                                     stages))
            n, finish = len(done), "length"
            while n < sampling.max_tokens:
                tok, lp, top = sampler.pick(logits)
                if tok in self.engine.eos_ids:
                    finish = "stop"
                    break
                n += 1
                if n == len(done) + 1:
                    stages["first_token"] = time.perf_counter() - t_suffix
                delta = stream.push(tok)
                if stream.stopped or n == sampling.max_tokens:
                    delta += stream.finish()
                yield TokenEvent(tok, delta, n - 1, lp, top)
                if pending is not None:      # the first token is out: the held copy runs beside decoding
                    copy, pending = self.held.put_copy(prefix_ids, salt, pending), None
                if stream.stopped:
                    finish = "stop"
                    break
                if n < sampling.max_tokens:
                    logits, pos = session.step([tok], [pos]), pos + 1
        finally:             # no token (EOS first), cancelled (closed) or failed: the prefix is still kept
            if pending is not None:
                copy = self.held.put_copy(prefix_ids, salt, pending)
        stream.finish()       # after EOS: text still held back is in the summary's text, not in an event
        text = stream.text
        if copy is not None:  # joined before the summary, which reports it (after the first token)
            copy.wait()
            stages["held_copy"] = copy.seconds
        yield DecodeSummary(n, finish, tuple(fallbacks), received, text, not_computed, min(loaded, not_computed),
                            tuple(stages.items()))


    def _guide(self, sampling: SamplingParams, vocab: int, done, stages: dict):
        """The request's grammar matcher (None without a constraint), past the tokens ``done``."""
        if sampling.constraint is None:
            return None
        from decode_workers.structured import GrammarCache
        if self._grammars is None:
            self._grammars = GrammarCache(self.engine.tokenizer, vocab, self.engine.eos_ids,
                                          max_entries=self.grammar_cache_entries)
        guide = self._grammars.guide(sampling.constraint)
        if guide.compile_seconds:
            stages["grammar_compile"] = guide.compile_seconds
        guide.replay(done)
        return guide


def _join(pinned: KVCache, kv: KVCache, buf: torch.Tensor | None) -> tuple[KVCache, torch.Tensor | None]:
    """The held slots then the received ones: written into the receive buffer's leading slots
    (its layout left them free; only the held part is copied), else concatenated."""
    if buf is None:
        return KVCache.cat([pinned, kv]), None
    n = pinned.num_tokens + kv.num_tokens
    buf[:, :, :, :pinned.num_tokens] = pinned.data
    return KVCache(buf[:, :, :, :n], torch.cat([pinned.positions, kv.positions]),
                   torch.cat([pinned.token_ids, kv.token_ids])), buf


class _Unusable(Exception):
    """The received block cannot be joined to the held prefix (reason in the message)."""
