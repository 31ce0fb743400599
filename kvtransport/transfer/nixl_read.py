"""The receiving half of :class:`~kvtransport.transfer.nixl_transport.NixlTransport`: READ an offer's
payload from the sender's registered memory into a lease of our pool, piece by piece (each piece
CRC-32C'd on the transport's CRC thread while the next is READ), and for a streamed offer wait for each piece's announcement
(:class:`~kvtransport.transfer.nixl_wire.Avail`) while READing the ones already announced. Runs on the
transport's progress thread; uses its agent, lock, inbox, config and notification queues.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtransport.transfer.blocks import SlotLayout, checksum_extend
from kvtransport.transfer.nixl_wire import AVAIL, CANCEL, Offer, Reply
from kvtransport.transfer.interface import TransferState

log = logging.getLogger("kvtransport.transfer.nixl_transport")


class _CrcChain:
    """CRC-32C of pieces handed in order to the transport's one CRC thread (``_crc_pool``), so
    the receiver's CRC of piece k overlaps the READ of piece k+1 (libcrc32c releases the GIL)."""

    def __init__(self, executor: ThreadPoolExecutor):
        self.crc, self._ex, self._last = 0, executor, None

    def add(self, piece: np.ndarray) -> None:
        self._last = self._ex.submit(self._step, piece)

    def _step(self, piece: np.ndarray) -> None:
        self.crc = checksum_extend(self.crc, piece)

    def result(self) -> int:
        """The CRC-32C of every piece added, once they are all checked."""
        if self._last is not None:
            self._last.result()
        return self.crc


class NixlReader:
    """Mixin: ``_read``, ``_wait_ready`` and the notify helpers for NixlTransport (attributes:
    ``_agent``, ``_lock``, ``_inbox``, ``cfg``, ``_avail``, ``_deferred``, ``_dispatch``,
    ``counters``, ``_crc_pool``)."""

    def _read(self, peer: str, dest: np.ndarray, offer: Offer, notif: bytes,
              layout: SlotLayout | None = None) -> tuple[str, int | None]:
        """Pull ``offer`` into ``dest`` piece by piece (the last piece carries ``notif``; a
        streamed offer's pieces as they are announced); returns the final NIXL state and the
        CRC-32C of what arrived (None unless ``verify_crc``). ``layout``: each piece is READ as
        one descriptor per row segment, the rows ``layout.capacity`` slots apart in ``dest``."""
        deadline = time.monotonic() + self.cfg.read_timeout_s
        chain = _CrcChain(self._crc_pool) if self.cfg.verify_crc else None
        n, step, state = offer.nbytes, self.cfg.read_piece_bytes, "DONE"
        off, ready = 0, (0 if offer.streamed else n)
        while off < n:
            if ready <= off and (ready := self._wait_ready(offer.header.transfer_id, off, deadline)) <= off:
                return "ERR (the sender stopped streaming: cancelled or timed out)", None
            size = min(step, ready - off)
            segs = [(off, off, size)] if layout is None else list(layout.segments(off, size))
            with self._lock:
                local = self._agent.get_xfer_descs([(int(dest.ctypes.data) + d, k, 0) for d, _, k in segs], "DRAM")
                remote = self._agent.get_xfer_descs([(offer.addr + o, k, offer.dev_id) for _, o, k in segs], "DRAM")
                handle = self._agent.initialize_xfer("READ", local, remote, peer, notif if off + size == n else b"")
                try:
                    state = self._agent.transfer(handle)
                    while state == "PROC" and time.monotonic() < deadline:
                        state = self._agent.check_xfer_state(handle)
                finally:
                    self._agent.release_xfer_handle(handle)
            if state != "DONE":
                return state, None                       # pending CRC tasks keep their pieces' lease alive
            for d, _, k in segs if chain is not None else ():
                chain.add(dest[d:d + k])                 # CRC'd on its thread while the next piece is READ
            off += size
        if n == 0 and notif:
            with self._lock:
                self._safe_notify(peer, notif)
        return state, (chain.result() if chain else None)

    def _wait_ready(self, tid: str, off: int, deadline: float) -> int:
        """A streamed offer: poll notifications until more than ``off`` bytes of ``tid`` are
        announced (returns the announced count; <= ``off`` on cancel or timeout). Availability
        and cancels are applied at once; anything else waits in ``_deferred``."""
        if any(m[:1] in (AVAIL, CANCEL) for _, m in self._deferred):    # fetched with this offer's batch
            rest = collections.deque()
            for peer, msg in self._deferred:
                if msg[:1] in (AVAIL, CANCEL):
                    self._dispatch(peer, msg)
                else:
                    rest.append((peer, msg))
            self._deferred.clear()
            self._deferred.extend(rest)
        while True:
            a = self._avail.get(tid)
            if a is not None and a.ready > off:
                return a.ready
            if time.monotonic() > deadline or self._inbox.state(tid) is TransferState.ABORTED:
                return off
            with self._lock:
                notifs = self._agent.get_new_notifs()
            for peer, msgs in notifs.items():
                peer = peer.decode() if isinstance(peer, bytes) else peer
                for msg in msgs:
                    msg = bytes(msg)
                    if msg[:1] in (AVAIL, CANCEL):
                        self._dispatch(peer, msg)
                    else:
                        self._deferred.append((peer, msg))
            if not notifs:
                time.sleep(self.cfg.busy_poll_s)

    def _notify(self, peer: str, reply: Reply) -> None:
        with self._lock:
            self._safe_notify(peer, reply.encode())

    def _safe_notify(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:  # the peer is gone: it times out on its side; counted, logged
            self.counters["notify_failed"] += 1
            log.warning("NIXL notification to %s failed: %s", peer, exc)
