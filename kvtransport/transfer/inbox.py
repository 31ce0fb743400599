"""Where received KV blocks wait for their claim: the bounded :class:`Inbox` (bytes reserved per
transfer, one block per transfer id, duplicates refused, unclaimed blocks and unused grants
expire, counted) and its :class:`InboxStats`. The gRPC servicer and the NIXL progress thread
feed it (``begin`` / ``finish`` / ``abort``); the decode worker's
:class:`~kvtransport.transfer.endpoints.Receiver` announces the router's grants (``expect``) and
claims blocks (``claim``); the actor reports ``stats`` as Prometheus metrics.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import BlockError, KVBlock, KVBlockHeader, SlotLayout
from kvtransport.transfer.interface import TransferError, TransferState

log = logging.getLogger(__name__)

MAX_TRANSFER_ID = 256        # characters; the router's ids are far shorter (request id + suffix)


def shown_id(tid) -> str:
    """A transfer id as logs and error texts show it: itself when short and printable, else its
    first 32 characters, its length and a digest (a peer's 8 MiB id never reaches a log whole)."""
    if isinstance(tid, str) and len(tid) <= 64 and tid.isprintable():
        return tid
    import hashlib
    raw = tid if isinstance(tid, (bytes, bytearray)) else str(tid).encode(errors="replace")
    head = raw[:32].decode(errors="replace") if isinstance(tid, (bytes, bytearray)) else str(tid)[:32]
    return f"{head!r}... ({len(tid)} chars, sha256 {hashlib.sha256(raw).hexdigest()[:12]})"


@dataclass(frozen=True)
class InboxStats:
    held_bytes: int            # reserved by transfers in flight + verified, unclaimed blocks
    blocks: int                # verified, unclaimed blocks
    pending: int               # transfers begun and not finished
    expired: int               # unclaimed blocks dropped after the TTL (since start)
    refused: dict              # reason -> pushes refused before any payload (since start)
    rejected: int              # transfers that failed verification or were cancelled (since start)
    grants: int = 0            # transfers announced by the router and not pushed yet
    grants_expired: int = 0    # grants no push claimed within the TTL (since start)
    unchecked: int = 0         # blocks accepted without a checksum: same-host gRPC pushes (since start)
    roomless: int = 0          # granted room dropped (the buffer would not fit): received plain (since start)


class Inbox:
    """Verified blocks waiting for their claim, keyed by transfer id. Bounded in bytes: a
    transfer reserves its bytes at :meth:`begin` (refused when full), the claim or a failure
    releases them. A transfer id is accepted once: a second push of an id that is in flight,
    held, failed-unclaimed or claimed within the last ``remember`` claims is refused. Unclaimed
    blocks expire after ``ttl_s`` (counted, logged). All methods lock one condition variable.

    ``require_grant``: a push is accepted only for a transfer the router announced with
    :meth:`expect` (a :class:`~kvruntime.messages.transfer.TransferGrant`), whose credential and
    shape (model, dtype, token count, positions, token ids) the header must match; anything else
    is refused at :meth:`begin`, before a byte is reserved (``unknown_transfer``,
    ``bad_credential``, ``wrong_model``, ``wrong_dtype``, ``wrong_length``, ``wrong_tokens``).
    A refused push leaves the grant in place (a forger cannot burn a legitimate transfer).
    Unused grants expire after ``ttl_s`` (counted)."""

    def __init__(self, capacity_bytes: int, max_block_bytes: int, ttl_s: float, *, remember: int = 4096,
                 require_grant: bool = False, max_grants: int = 4096):
        if capacity_bytes <= 0 or max_block_bytes <= 0 or ttl_s <= 0 or max_grants <= 0:
            raise ValueError("inbox capacity, max block size, TTL and max_grants must be positive")
        self.require_grant, self._max_grants = require_grant, max_grants
        self._grants: collections.OrderedDict[str, tuple[TransferGrant, float]] = collections.OrderedDict()
        self._grants_expired = 0
        self.capacity, self.max_block, self.ttl = capacity_bytes, max_block_bytes, ttl_s
        self._cv = threading.Condition()
        self._state: dict[str, tuple[TransferState, str, int, float]] = {}  # tid -> (state, error, reserved bytes, since)
        self._blocks: dict[str, KVBlock] = {}                               # tid -> verified block (DONE)
        self._claimed: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent claims
        self._remember = remember
        self._held = 0
        self._expired = self._rejected = self._unchecked = self._roomless = 0
        self._refused: collections.Counter[str] = collections.Counter()
        self._owner: dict[str, str] = {}                                      # tid -> the peer that began it

    def expect(self, grant: TransferGrant) -> None:
        """Announce a transfer (the router, before the sender pushes). Raises ``ValueError`` for
        an id already announced or pushed, or when ``max_grants`` are outstanding."""
        with self._cv:
            self._expire()
            tid = grant.transfer_id
            if tid in self._grants or tid in self._state or tid in self._claimed:
                raise ValueError(f"transfer {tid} was already announced or pushed")
            if len(self._grants) >= self._max_grants:
                raise ValueError(f"{len(self._grants)} transfers announced and not pushed (max_grants)")
            self._grants[tid] = (grant, time.monotonic())

    def expecting(self) -> bool:
        """Whether an announced transfer has not begun yet (a transport polls faster meanwhile)."""
        return bool(self._grants)

    def _check_grant(self, tid: str, header: KVBlockHeader | None) -> tuple[str, str] | None:
        entry = self._grants.get(tid)
        if entry is None:
            return "unknown_transfer", f"transfer {shown_id(tid)} was not announced to this receiver"
        if header is None:
            return "unknown_transfer", f"transfer {shown_id(tid)}: no header to check against its grant"
        return entry[0].mismatch(credential=header.credential, model=header.model, dtype=header.dtype,
                                 positions=header.positions, token_ids=header.token_ids)

    def begin(self, tid: str, nbytes: int, header: KVBlockHeader | None = None, *,
              peer: str | None = None) -> SlotLayout | None:
        """Reserve ``nbytes`` for ``tid`` (state TRANSFERRING) or raise :class:`TransferError`
        (``bad_transfer_id``, ``too_large``, ``duplicate``, ``backpressure``, or a grant reason,
        see the class) without reserving anything. ``header``: the block's header (checked against
        the grant); ``peer``: who pushes it (only that peer may :meth:`abort` it). Returns the
        receive layout when the grant asks for room (:meth:`_layout`; its bytes are reserved), else None."""
        with self._cv:
            self._expire()
            layout = self._layout(tid, header, nbytes)
            if layout is not None:
                nbytes = layout.nbytes
            reason, msg = None, ""
            if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID:
                reason, msg = "bad_transfer_id", f"transfer id {shown_id(tid)} is not 1-{MAX_TRANSFER_ID} characters"
            elif nbytes > self.max_block:
                reason, msg = "too_large", f"block of {nbytes} bytes exceeds max_block_bytes {self.max_block}"
            elif tid in self._state or tid in self._claimed:
                reason, msg = "duplicate", f"transfer id {shown_id(tid)} was already pushed to this receiver"
            elif self.require_grant and (bad := self._check_grant(tid, header)) is not None:
                reason, msg = bad
            elif self._held + nbytes > self.capacity:
                reason, msg = "backpressure", f"inbox full ({self._held} of {self.capacity} bytes held)"
            if reason is not None:
                self._refused[reason] += 1
                log.warning("refused KV transfer %s: %s", shown_id(tid), msg)
                raise TransferError(reason, msg)
            self._grants.pop(tid, None)
            if peer is not None:
                self._owner[tid] = peer
            self._held += nbytes
            self._state[tid] = (TransferState.TRANSFERRING, "", nbytes, time.monotonic())
            return layout

    def _layout(self, tid: str, header: KVBlockHeader | None, nbytes: int) -> SlotLayout | None:
        """The granted room as a :class:`SlotLayout` (the block at ``first_position`` of ``first_position
        + tokens + room`` slots); dropped (``roomless``, a plain block) when that buffer would not fit
        ``max_block_bytes`` or the free inbox bytes while the plain block would. Under the lock."""
        entry = self._grants.get(tid)
        if entry is None or entry[0].room is None or header is None or not header.num_tokens:
            return None
        g = entry[0]
        try:
            layout = SlotLayout.of(header, g.first_position, g.first_position + header.num_tokens + g.room)
        except BlockError:
            return None                      # the header is refused below (or by the transport's check)
        if layout.nbytes > self.max_block or self._held + layout.nbytes > self.capacity >= self._held + nbytes:
            self._roomless += 1
            return None
        return layout

    def finish(self, tid: str, block: KVBlock | None, error: str = "", *, unchecked: bool = False) -> None:
        """Complete ``tid`` begun by :meth:`begin`: DONE with ``block`` (keeps its reservation
        until claimed) or FAILED with ``error`` (reservation released). Wakes waiting claims.
        ``unchecked``: the block arrived without a checksum (a same-host gRPC push, counted)."""
        with self._cv:
            state = self._state.get(tid)
            if state is None or state[0] is not TransferState.TRANSFERRING:
                log.warning("finish of KV transfer %s that is not in flight (%s) ignored", shown_id(tid), state)
                return
            if block is None:
                self._held -= state[2]
                self._rejected += 1
                self._state[tid] = (TransferState.FAILED, error, 0, time.monotonic())
            else:
                self._blocks[tid] = block
                self._unchecked += unchecked
                self._state[tid] = (TransferState.DONE, "", state[2], time.monotonic())
            self._cv.notify_all()

    def abort(self, tid: str, error: str, *, peer: str | None = None) -> bool:
        """Drop ``tid`` in any state but claimed (a sender's cancel): ABORTED, bytes released.
        ``peer``: who asks; only the peer that began ``tid`` may (anyone else's cancel is refused,
        counted as ``foreign_cancel``, logged with the id bounded). Returns whether it was dropped."""
        with self._cv:
            state = self._state.get(tid)
            if state is None:
                return False                         # nothing begun under this id: nothing to cancel
            if peer is not None and self._owner.get(tid) != peer:
                self._refused["foreign_cancel"] += 1
                log.warning("ignored a cancel of KV transfer %s from %s: not a transfer that peer pushes",
                            shown_id(tid), peer)
                return False
            if state[0] in (TransferState.FAILED, TransferState.ABORTED):
                return False
            self._held -= state[2]
            self._blocks.pop(tid, None)
            self._rejected += 1
            self._state[tid] = (TransferState.ABORTED, error, 0, time.monotonic())
            self._owner.pop(tid, None)
            self._cv.notify_all()
            return True

    def claim(self, tid: str, timeout: float) -> KVBlock:
        """Wait up to ``timeout`` s for ``tid``; return its block and forget it (releasing its
        bytes). Raises :class:`TransferError` ``rejected`` (failed/aborted) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                state, err, nbytes, _ = self._state.get(tid, (TransferState.PENDING, "", 0, 0.0))
                if state is TransferState.DONE:
                    del self._state[tid]
                    self._held -= nbytes
                    self._remember_claim(tid)
                    return self._blocks.pop(tid)
                if state in (TransferState.FAILED, TransferState.ABORTED):
                    del self._state[tid]
                    self._remember_claim(tid)
                    raise TransferError("rejected", f"transfer {tid} {state.value}: {err}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError("timeout", f"transfer {tid} not received within {timeout:.1f} s")
                self._cv.wait(left)

    def refuse(self, tid: str, reason: str, msg: str) -> None:
        """Count and log a push of ``tid`` refused before :meth:`begin` by its transport (e.g.
        ``checksum_required``); nothing is reserved and the grant stays for a proper retry."""
        with self._cv:
            self._refused[reason] += 1
        log.warning("refused KV transfer %s: %s", shown_id(tid), msg)

    def state(self, tid: str) -> TransferState:
        with self._cv:
            return self._state.get(tid, (TransferState.PENDING,))[0]

    def stats(self) -> InboxStats:
        with self._cv:
            self._expire()
            pending = sum(1 for s in self._state.values() if s[0] is TransferState.TRANSFERRING)
            return InboxStats(self._held, len(self._blocks), pending, self._expired, dict(self._refused),
                              self._rejected, len(self._grants), self._grants_expired, self._unchecked,
                              self._roomless)

    def _remember_claim(self, tid: str) -> None:
        self._owner.pop(tid, None)
        self._claimed[tid] = None
        while len(self._claimed) > self._remember:
            self._claimed.popitem(last=False)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._grants and now - next(iter(self._grants.values()))[1] > self.ttl:
            tid, _ = self._grants.popitem(last=False)
            self._grants_expired += 1
            log.warning("grant for KV transfer %s expired unused after %.0f s", tid, self.ttl)
        for tid, (state, _, nbytes, since) in list(self._state.items()):
            if now - since <= self.ttl:
                continue
            if state is TransferState.DONE:
                del self._blocks[tid]
                self._held -= nbytes
                self._expired += 1
                self._state[tid] = (TransferState.ABORTED, "expired unclaimed", 0, now)
                log.warning("dropped unclaimed KV block %s (%d bytes) after %.0f s", tid, nbytes, self.ttl)
            elif state in (TransferState.FAILED, TransferState.ABORTED):
                del self._state[tid]                 # nobody claimed the failure: forget it (and its owner)
                self._remember_claim(tid)

