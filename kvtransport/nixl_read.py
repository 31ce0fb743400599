"""The receiving half of :class:`~kvtransport.nixl_transport.NixlTransport`: READ an offer's
payload from the sender's registered memory into a lease of our pool, piece by piece (each piece
CRC-32C'd while in cache), and for a streamed offer wait for each piece's announcement
(:class:`~kvtransport.nixl_wire.Avail`) while READing the ones already announced. Runs on the
transport's progress thread; uses its agent, lock, inbox, config and notification queues.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from kvtransport.blocks import checksum_extend
from kvtransport.nixl_wire import AVAIL, CANCEL, Offer
from kvtransport.transport import TransferState


class NixlReader:
    """Mixin: ``_read`` and ``_wait_ready`` for NixlTransport (attributes: ``_agent``, ``_lock``,
    ``_inbox``, ``cfg``, ``_avail``, ``_deferred``, ``_dispatch``, ``_safe_notify``)."""

    def _read(self, peer: str, dest: np.ndarray, offer: Offer, notif: bytes) -> tuple[str, int | None]:
        """Pull ``offer`` into ``dest`` piece by piece (the last piece carries ``notif``; a
        streamed offer's pieces as they are announced); returns the final NIXL state and the
        CRC-32C of what arrived (None unless ``verify_crc``)."""
        deadline = time.monotonic() + self.cfg.read_timeout_s
        crc, n, step, state = (0 if self.cfg.verify_crc else None), offer.nbytes, self.cfg.read_piece_bytes, "DONE"
        off, ready = 0, (0 if offer.streamed else n)
        while off < n:
            if ready <= off and (ready := self._wait_ready(offer.header.transfer_id, off, deadline)) <= off:
                return "ERR (the sender stopped streaming: cancelled or timed out)", crc
            size = min(step, ready - off)
            with self._lock:
                local = self._agent.get_xfer_descs([(int(dest.ctypes.data) + off, size, 0)], "DRAM")
                remote = self._agent.get_xfer_descs([(offer.addr + off, size, offer.dev_id)], "DRAM")
                handle = self._agent.initialize_xfer("READ", local, remote, peer, notif if off + size == n else b"")
                try:
                    state = self._agent.transfer(handle)
                    while state == "PROC" and time.monotonic() < deadline:
                        state = self._agent.check_xfer_state(handle)
                finally:
                    self._agent.release_xfer_handle(handle)
            if state != "DONE":
                return state, crc
            if crc is not None:
                crc = checksum_extend(crc, dest[off:off + size])
            off += size
        if n == 0 and notif:
            with self._lock:
                self._safe_notify(peer, notif)
        return state, crc

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
