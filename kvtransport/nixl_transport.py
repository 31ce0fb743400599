"""KV blocks over NIXL (UCX): registered memory, one-sided READ, completion by notification.

Design (after vLLM's NixlConnector and NIXL's examples/python, shaped for our push seam):
- **One agent per transport**, created once per process/actor with ``enable_prog_thread=False``
  (nixl 1.5.1's progress thread busy-polls a core). Progress happens in our own thread, which
  polls ``get_new_notifs`` every 0.2 ms while a transfer of ours is open and backs off to
  ``idle_poll_s`` when idle, and in the READ loop. All agent calls hold one lock.
- **One registered arena** (:class:`~kvtransport.transport.BufferPool`, DRAM, ``pool_bytes``)
  registered once at start; both the send staging copy and received blocks are leases of it.
  No registration per request. A received block's payload *is* its lease (no copy out): the
  range returns to the pool when the block and every tensor decoded from it are dropped.
- **Metadata through the caller**: :meth:`NixlTransport.metadata` / :meth:`add_peer` (Ray
  actors pass the bytes through their handles). Only the sender needs the receiver's metadata:
  its first offer to a peer carries its own, which the receiver loads (no side channel).
- **Flow** (``send(peer, block)``; the receiver pulls, like vLLM's decode side): 1. the sender
  stages the payload in a lease (none if encoded into one: ``encode_block(..., into=
  transport.lease)``) and notifies ``OFFER`` (header + address); 2. the receiver checks the
  header (duplicate id, inbox room, model, dtype/shape vs length), leases a destination and READs
  in pieces, CRC-32C'ing each while in cache (``verify_crc``: cma is a kernel memcpy, the CRC
  guards against forged/corrupt blocks and stale staging); NIXL notifies ``PULLED`` + id and the
  sender frees its staging; 3. the block becomes visible, the receiver notifies ``REPLY`` + id
  (ok, or a :class:`TransferError` reason: ``duplicate``, ``backpressure``, ``too_large``,
  ``rejected``, ``nixl_error``); ``send`` returns or raises on it. A sender that times out
  notifies ``CANCEL`` and keeps its staging until ``PULLED`` or the TTL.
Same host: UCX picks ``cma``; across hosts tcp/RDMA (``UCX_TLS``, ``UCX_NET_DEVICES``). No VRAM
pool: blocks are CPU bytes by construction (``encode_block`` moves KV to the CPU).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from kvtransport.blocks import BlockError, KVBlock, KVBlockHeader, as_bytes_array, checksum_extend, payload_len
from kvtransport.grpc_codec import header_from_bytes, header_to_bytes
from kvtransport.transport import BufferPool, Inbox, InboxStats, KVTransport, TransferError, TransferReceipt, \
    TransferState

log = logging.getLogger(__name__)

_OFFER, _PULLED, _REPLY, _CANCEL = b"O", b"P", b"R", b"C"   # notification kinds (first byte)
_OFFER_FIXED = struct.Struct("<QQIII")      # addr, nbytes, dev_id, len(metadata), len(header)


@dataclass(frozen=True)
class NixlTransportConfig:
    pool_bytes: int = 1 << 30               # registered arena (staging + received blocks), bytes
    max_block_bytes: int = 1 << 30          # larger offers are refused (too_large)
    inbox_bytes: int = 1 << 30              # in-flight + verified-unclaimed bytes before refusing
    unclaimed_ttl_s: float = 300.0          # unclaimed blocks (and unpulled staging) dropped after
    idle_poll_s: float = 0.002              # notification poll period when nothing is open, s
    busy_poll_s: float = 0.0002             # poll period while a transfer is open, s
    read_timeout_s: float = 60.0            # a READ still in progress after this fails
    read_piece_bytes: int = 8 << 20         # READ in pieces this big, each CRC'd while in cache
    verify_crc: bool = True                 # receiver checks CRC-32C before a block is visible
    require_grant: bool = False             # accept only transfers announced by expect() (the cluster: True)
    backends: tuple[str, ...] = ("UCX",)

    def __post_init__(self):
        if self.pool_bytes <= 0 or self.max_block_bytes <= 0 or self.inbox_bytes <= 0:
            raise ValueError("pool_bytes, max_block_bytes and inbox_bytes must be positive")
        if self.read_piece_bytes <= 0 or not 0 < self.busy_poll_s <= self.idle_poll_s:
            raise ValueError("need read_piece_bytes > 0 and 0 < busy_poll_s <= idle_poll_s")


@dataclass(frozen=True)
class Offer:
    """Sender -> receiver: pull this block from my registered memory."""
    header: KVBlockHeader
    addr: int                 # virtual address of the staged payload in the sender's process
    nbytes: int               # staged bytes (the receiver checks them against the header)
    dev_id: int               # NIXL device id of that memory (0 for DRAM)
    metadata: bytes           # the sender's agent metadata on a first offer, else b""

    def encode(self) -> bytes:
        hdr = header_to_bytes(self.header)
        return b"".join((_OFFER, _OFFER_FIXED.pack(self.addr, self.nbytes, self.dev_id, len(self.metadata), len(hdr)),
                         self.metadata, hdr))

    @staticmethod
    def decode(msg: bytes) -> "Offer":
        """Raises ``ValueError`` for a malformed offer."""
        n = 1 + _OFFER_FIXED.size
        addr, nbytes, dev, lmd, lhdr = _OFFER_FIXED.unpack_from(msg, 1) if len(msg) >= n else (0, 0, 0, -1, 0)
        if lmd < 0 or len(msg) != n + lmd + lhdr:
            raise ValueError("offer too short or its length does not match its fields")
        return Offer(header_from_bytes(msg[n + lmd:]), addr, nbytes, dev, bytes(msg[n:n + lmd]))


@dataclass(frozen=True)
class Reply:
    """Receiver -> sender: the verdict on an offer."""
    transfer_id: str
    ok: bool
    reason: str = ""          # TransferError reason when not ok
    error: str = ""

    def encode(self) -> bytes:
        return _REPLY + json.dumps([self.transfer_id, self.ok, self.reason, self.error]).encode()

    @staticmethod
    def decode(msg: bytes) -> "Reply":
        tid, ok, reason, error = json.loads(msg[1:])
        return Reply(str(tid), bool(ok), str(reason), str(error))


@dataclass
class _Outgoing:              # one open send, owned by the sending thread + the progress thread
    peer: str
    staging: np.ndarray | None              # [nbytes] uint8 lease, dropped on PULLED / reply / TTL
    since: float                            # time.monotonic() of the offer
    done: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None


class NixlTransport(KVTransport):
    """Both ends over one NIXL agent. Receiver: give :meth:`metadata` (and :attr:`name`, the
    address senders use) to senders; then :meth:`receive`. Sender: :meth:`add_peer`, then
    :meth:`send`. Starts the agent, registers the pool and starts the progress thread."""

    def __init__(self, cfg: NixlTransportConfig = NixlTransportConfig(), *, model: str | None = None,
                 name: str | None = None, inbox: Inbox | None = None):
        from nixl._api import nixl_agent, nixl_agent_config        # lazy: only this backend needs NIXL
        self.cfg, self.model = cfg, model
        self.name = name or f"kvnotes-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=list(cfg.backends)))
        self._lock = threading.RLock()                              # every agent call
        self._pool = BufferPool(cfg.pool_bytes)
        self._reg = self._agent.register_memory([(self._pool.address, cfg.pool_bytes, 0, "")], "DRAM")
        self._inbox = inbox or Inbox(cfg.inbox_bytes, cfg.max_block_bytes, cfg.unclaimed_ttl_s,
                                     require_grant=cfg.require_grant)
        self._peers: set[str] = set()                               # agents whose metadata is loaded
        self._introduced: set[str] = set()                          # peers sent our metadata
        self._out: dict[str, _Outgoing] = {}                        # transfer id -> open send
        self._quarantine: dict[str, _Outgoing] = {}                 # timed-out send -> staging kept until PULLED/TTL
        self._out_lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()  # fallback/failure kind -> count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name=f"nixl-progress-{self.name}", daemon=True)
        self._thread.start()

    # ---- metadata ------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory), for :meth:`add_peer`."""
        with self._lock:
            return self._agent.get_agent_metadata()

    def add_peer(self, name: str, metadata: bytes) -> str:
        """Load a peer's metadata so that :meth:`send` can reach it as ``name``. Idempotent.
        Raises ``ValueError`` if the metadata is unusable or names another agent."""
        if name in self._peers:
            return name
        if name == self.name:
            raise ValueError(f"agent {name!r} is this transport itself")
        try:
            with self._lock:
                loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:  # nixl's own error types for unparsable/duplicate metadata
            raise ValueError(f"cannot load NIXL metadata for agent {name!r}: {exc}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            raise ValueError(f"metadata is of agent {loaded!r}, not {name!r}")
        self._peers.add(name)
        return name

    # ---- sending -------------------------------------------------------------------------------
    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        """Offer ``block`` to the peer named ``address`` and block until it has pulled and verified
        it. Copies the payload once into a staging lease unless it already is one (see
        :meth:`lease`). Raises :class:`TransferError`
        (``unknown_peer``, ``too_large``, ``backpressure``, ``duplicate``, ``timeout``, or the
        receiver's reason)."""
        t0, deadline = time.perf_counter(), time.monotonic() + timeout
        tid, n = block.header.transfer_id, payload_len(block.payload)
        if address not in self._peers:
            raise TransferError("unknown_peer", f"no metadata for NIXL peer {address!r}: call add_peer first")
        if n > self.cfg.pool_bytes:
            raise TransferError("too_large", f"block of {n} bytes exceeds the NIXL pool ({self.cfg.pool_bytes})")
        staging = as_bytes_array(block.payload) if n else None
        if staging is None or not self._in_pool(staging):          # not encoded into our pool: stage it
            staging = self._pool.lease(n)
            while staging is None:
                if time.monotonic() > deadline:
                    raise TransferError("backpressure", f"NIXL send pool full for {tid} ({n} bytes)")
                time.sleep(self.cfg.busy_poll_s * 10)
                staging = self._pool.lease(n)
            staging[:] = as_bytes_array(block.payload)
        out = _Outgoing(address, staging, time.monotonic())
        with self._out_lock:
            if tid in self._out:
                raise TransferError("duplicate", f"transfer id {tid} is already being sent")
            self._out[tid] = out
        del staging
        md = b"" if address in self._introduced else self.metadata()
        offer = Offer(block.header, int(out.staging.ctypes.data), n, 0, md)
        try:
            with self._lock:
                self._agent.send_notif(address, offer.encode())
        except Exception as exc:  # nixl raises its own error types; the send fails, reported
            self._forget(tid)
            raise TransferError("unavailable", f"NIXL notify to {address} failed: {exc}") from None
        self._introduced.add(address)
        if not out.done.wait(max(0.0, deadline - time.monotonic())):
            self.counters["send_timeout"] += 1
            with self._lock:
                self._safe_notify(address, _CANCEL + tid.encode())
            with self._out_lock:                                   # keep staging until PULLED or TTL
                self._out.pop(tid, None)
                if out.staging is not None:
                    self._quarantine[tid] = out
            raise TransferError("timeout", f"NIXL transfer {tid} to {address} not verified within {timeout:.1f} s")
        self._forget(tid)
        if not (reply := out.reply).ok:
            raise TransferError(reply.reason or "rejected", f"receiver rejected {tid}: {reply.error}")
        return TransferReceipt(tid, n, time.perf_counter() - t0)

    def lease(self, nbytes: int) -> np.ndarray | None:
        """Registered memory (None when full) for ``encode_block(into=...)``: sent without staging."""
        return self._pool.lease(nbytes)

    def _in_pool(self, arr: np.ndarray) -> bool:
        return self._pool.address <= int(arr.ctypes.data) <= self._pool.address + self._pool.nbytes - arr.nbytes

    def _forget(self, tid: str) -> None:
        with self._out_lock:
            out = self._out.pop(tid, None)
        if out is not None:
            out.staging = None                                     # the staging lease ends here

    # ---- receiving -----------------------------------------------------------------------------
    def receive(self, transfer_id: str, *, timeout: float = 30.0) -> KVBlock:
        """Claim a verified block (see :class:`KVTransport`). Its payload leases pool memory until
        the block and every tensor decoded from it are dropped."""
        return self._inbox.claim(transfer_id, timeout)

    def state(self, transfer_id: str) -> TransferState:
        return self._inbox.state(transfer_id)

    def expect(self, grant) -> None:  # announce a transfer (see Inbox.expect)
        self._inbox.expect(grant)

    stats = lambda self: self._inbox.stats()  # noqa: E731 -- InboxStats: held bytes, expiries, refusals
    pool = property(lambda self: self._pool, doc="the registered arena (staging + received blocks)")
    kind = "nixl"

    def stop(self) -> None:  # stop the progress thread, deregister the pool; idempotent, joins the thread
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        with self._lock:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:  # already torn down by NIXL: nothing left to release, logged
                log.warning("NIXL deregister of %s failed: %s", self.name, exc)

    # ---- progress thread ----------------------------------------------------------------------
    def _progress(self) -> None:
        delay, last_sweep = self.cfg.busy_poll_s, time.monotonic()
        while not self._stop.is_set():
            try:
                with self._lock:
                    notifs = self._agent.get_new_notifs()
                for peer, msgs in notifs.items():
                    peer = peer.decode() if isinstance(peer, bytes) else peer
                    for msg in msgs:
                        self._dispatch(peer, bytes(msg))
            except Exception:  # the thread must survive anything a peer sends; counted, logged
                self.counters["progress_error"] += 1
                log.exception("NIXL progress loop error in %s", self.name)
                notifs = {}
            if time.monotonic() - last_sweep > 1.0:
                last_sweep = time.monotonic()
                self._sweep()
            busy = bool(notifs) or bool(self._out)
            delay = self.cfg.busy_poll_s if busy else min(self.cfg.idle_poll_s, delay * 2)
            self._stop.wait(delay)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._out_lock:
            for tid in [t for t, o in self._quarantine.items() if now - o.since > self.cfg.unclaimed_ttl_s]:
                self._quarantine.pop(tid).staging = None
        self._inbox.stats()                                        # runs the inbox's expiry

    def _dispatch(self, peer: str, msg: bytes) -> None:
        kind, body = msg[:1], msg[1:]
        if kind == _OFFER:
            try:
                offer = Offer.decode(msg)
            except ValueError as exc:
                self.counters["bad_offer"] += 1
                log.warning("malformed NIXL offer from %s dropped: %s", peer, exc)
                return
            self._on_offer(peer, offer)
        elif kind in (_PULLED, _REPLY):
            reply = Reply.decode(msg) if kind == _REPLY else None
            tid = reply.transfer_id if reply else body.decode()
            with self._out_lock:
                out = self._out.get(tid) or self._quarantine.pop(tid, None)
            if out is None:                                        # PULLED may trail the REPLY: harmless
                if reply is not None:
                    self.counters["late_reply"] += 1
                    log.info("NIXL reply for closed transfer %s from %s: %s", tid, peer, reply)
                return
            out.staging = None                                     # pulled (or refused): staging is free
            if reply is not None:
                out.reply = reply
                out.done.set()
        elif kind == _CANCEL:
            self._inbox.abort(body.decode(), f"cancelled by sender {peer}")
        else:
            self.counters["bad_notification"] += 1
            log.warning("unknown NIXL notification %r from %s dropped", msg[:16], peer)

    def _notify(self, peer: str, reply: Reply) -> None:
        with self._lock:
            self._safe_notify(peer, reply.encode())

    def _safe_notify(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:  # the peer is gone: it times out on its side; counted, logged
            self.counters["notify_failed"] += 1
            log.warning("NIXL notification to %s failed: %s", peer, exc)

    def _on_offer(self, peer: str, offer: Offer) -> None:
        h, tid = offer.header, offer.header.transfer_id
        if peer not in self._peers:
            try:
                self.add_peer(peer, offer.metadata)
            except Exception as exc:  # cannot pull nor answer without its metadata; the sender times out
                self.counters["unknown_peer"] += 1
                log.warning("NIXL offer %s from %s without usable metadata dropped: %s", tid, peer, exc)
                return
        try:
            self._inbox.begin(tid, h.payload_bytes, h)
        except TransferError as exc:
            return self._notify(peer, Reply(tid, False, exc.reason, str(exc)))
        try:
            h.check(model=self.model, payload_bytes=offer.nbytes)
        except BlockError as exc:
            return self._fail(peer, tid, "rejected", str(exc))
        dest = self._pool.lease(offer.nbytes)
        if dest is None:
            self.counters["pool_full"] += 1
            return self._fail(peer, tid, "backpressure", f"NIXL receive pool full ({self._pool.leased_bytes} leased)")
        try:
            state, crc = self._read(peer, dest, offer, _PULLED + tid.encode())
        except Exception as exc:  # a NIXL/UCX error fails this transfer only; counted, logged
            state, crc = f"ERR ({type(exc).__name__}: {exc})", None
        if state != "DONE":
            self.counters["nixl_error"] += 1
            return self._fail(peer, tid, "nixl_error", f"NIXL READ of {tid} from {peer}: {state}")
        if crc is not None and crc != h.checksum:
            return self._fail(peer, tid, "rejected", f"checksum mismatch on {tid}: header {h.checksum:#010x}, "
                                                     f"payload {crc:#010x}")
        payload = memoryview(dest)
        self._inbox.finish(tid, KVBlock.verified(h, payload) if crc is not None else KVBlock(h, payload))
        self._notify(peer, Reply(tid, True))

    def _read(self, peer: str, dest: np.ndarray, offer: Offer, notif: bytes) -> tuple[str, int | None]:
        """Pull ``offer`` into ``dest`` piece by piece (the last piece carries ``notif``); returns
        the final NIXL state and the CRC-32C of what arrived (None unless ``verify_crc``)."""
        deadline = time.monotonic() + self.cfg.read_timeout_s
        crc, n, step, state = (0 if self.cfg.verify_crc else None), offer.nbytes, self.cfg.read_piece_bytes, "DONE"
        for off in range(0, n, step):
            size = min(step, n - off)
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
        if n == 0 and notif:
            with self._lock:
                self._safe_notify(peer, notif)
        return state, crc

    def _fail(self, peer: str, tid: str, reason: str, error: str) -> None:
        log.warning("rejected NIXL KV block %s from %s: %s", tid, peer, error)
        self._inbox.finish(tid, None, error)
        self._notify(peer, Reply(tid, False, reason, error))
