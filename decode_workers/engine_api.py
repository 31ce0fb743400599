"""The decode engine's contract: what :class:`~decode_workers.actor.DecodeWorker` needs from the
engine it runs, declared once. Both engines implement it: the reference one
(:class:`~decode_workers.executor.DecodeExecutor`, torch, the oracle) and vLLM's
(:class:`~decode_workers.vllm_engine.VllmDecodeExecutor`). The actor never asks which one it
holds; :func:`decode_workers.engines.make_decode_engine` is the one place that reads
``decode_engine`` from config.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterator

from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent
from kvruntime.messages.transfer import TransferGrant

if TYPE_CHECKING:
    from decode_workers.held_kv import HeldPrefixes


class DecodeEngine(ABC):
    #: ``decode_engine`` in config: what ``DecodeWorker.ready`` reports
    kind: str = ""
    #: prefix KV this engine keeps between requests itself (the reference engine's); None when
    #: the engine has its own prefix cache (vLLM) or keeps none
    held: "HeldPrefixes | None" = None
    #: whether the prefix block is received into a buffer with room for the suffix and the tokens to
    #: come (the grant's ``room``), the buffer the engine then decodes in (the reference engine's)
    receive_room: bool = False

    @abstractmethod
    def hold(self, grant: TransferGrant, prefix_ids: tuple[int, ...], salt: str | None,
             computes_from: int | None = None) -> int:
        """How many leading tokens of ``prefix_ids`` (those of ``grant``) this engine holds under
        ``salt`` now, kept for ``grant``'s transfer when the engine pins KV: the part no prefill
        worker builds or sends. At most ``grant.tokens``; an engine that must receive at least
        one token (its one receive path) answers fewer unless they reach ``computes_from``."""

    @abstractmethod
    def generate(self, transfer_id: str | None, prefix_ids: tuple[int, ...], suffix_ids: tuple[int, ...],
                 sampling: SamplingParams, *, salt: str | None = None, held_only: bool = False,
                 continuation: Continuation | None = None) -> Iterator[TokenEvent | DecodeSummary]:
        """One :class:`TokenEvent` per generated token, then a :class:`DecodeSummary`.
        ``transfer_id``: the block pushed for this request (None: none was sent, the prefix is
        computed here); ``held_only``: no block comes for ``transfer_id``, the prefix is what
        :meth:`hold` kept plus the rest, computed here; ``continuation``: resume a stream another
        worker started and lost."""

    def stop(self) -> None:
        """Release the engine's threads and registrations (default: nothing to release)."""
