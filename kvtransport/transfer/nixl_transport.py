"""KV blocks over NIXL (UCX): registered memory, one-sided READ, completion by notification.

Design (after vLLM's NixlConnector and NIXL's examples/python, shaped for our push seam):
- **One agent per transport**, created once per process/actor with ``enable_prog_thread=False``
  (nixl 1.5.1's progress thread busy-polls a core). Progress happens in our own thread, which
  polls ``get_new_notifs`` every 0.2 ms while a transfer of ours is open and backs off to
  ``expect_poll_s`` while a granted transfer is awaited, ``idle_poll_s`` when nothing is (an
  idle agent: ~1% of a core; a send or a grant wakes it at once), and in the READ loop. All agent calls hold one lock.
- **One registered arena** (:class:`~kvtransport.transfer.buffer_pool.BufferPool`, DRAM, ``pool_bytes``)
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
  in pieces, each CRC-32C'd on the CRC thread while the next is READ (``verify_crc``: cma is a
  kernel memcpy; the CRC guards against forged/corrupt blocks and stale staging); NIXL notifies
  ``PULLED`` + id (the sender frees its staging); 3. the block becomes visible, the receiver
  notifies ``REPLY`` + id (ok, or a :class:`TransferError` reason: ``duplicate``, ``backpressure``,
  ``too_large``, ``rejected``, ``nixl_error``, or a grant refusal, see ``Inbox``). A sender that
  times out notifies ``CANCEL`` and keeps its staging until ``PULLED`` or TTL.
- **Pipelined** (``send_kv``, what :class:`~kvtransport.transfer.endpoints.Sender` uses, see
  :mod:`kvtransport.transfer.nixl_send`): the offer goes out first (``STREAM``), then every
  ``stream_piece_bytes`` is announced (``AVAIL``) as soon as it is in place; the receiver READs
  each announced piece while the next is prepared (see :mod:`kvtransport.transfer.nixl_read`); the last
  ``AVAIL`` carries the CRC-32C, checked before the block is visible. KV the prefill built in a
  lease of this pool is sent **without a copy** (each piece only CRC'd, then announced); other
  KV is copied (and cast to the wire dtype, in the same pass) into a lease piece by piece, the
  CRC thread checksumming each piece. The pool is huge-page backed (``BufferPool``): cma pins
  2 MiB pages.
Same host: UCX picks ``cma``; across hosts tcp/RDMA (``UCX_TLS``, ``UCX_NET_DEVICES``). No VRAM pool:
blocks are CPU bytes by construction.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtransport.transfer.blocks import BlockError, KVBlock
from kvtransport.transfer.nixl_read import NixlReader
from kvtransport.transfer.nixl_send import NixlSender, _Outgoing
from kvtransport.transfer.nixl_wire import AVAIL, CANCEL, OFFER, PULLED, REPLY, STREAM, Avail, Offer, Reply
from kvtransport.transfer.buffer_pool import BufferPool
from kvtransport.transfer.inbox import MAX_TRANSFER_ID, Inbox, shown_id
from kvtransport.transfer.interface import KVTransport, TransferError, TransferState

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class NixlTransportConfig:
    pool_bytes: int = 1 << 30               # registered arena (staging + received blocks), bytes
    max_block_bytes: int = 1 << 30          # larger offers are refused (too_large)
    inbox_bytes: int = 1 << 30              # in-flight + verified-unclaimed bytes before refusing
    unclaimed_ttl_s: float = 300.0          # unclaimed blocks (and unpulled staging) dropped after
    idle_poll_s: float = 0.02               # notification poll period when nothing is open or expected, s
    expect_poll_s: float = 0.002            # ... while a granted transfer (Inbox.expect) has not arrived, s
    busy_poll_s: float = 0.0002             # poll period while a transfer is open, s
    read_timeout_s: float = 60.0            # a READ still in progress after this fails
    read_piece_bytes: int = 8 << 20         # READ in pieces this big (4-32 MiB measured: 8-16 best)
    stream_piece_bytes: int = 16 << 20      # send_kv: announce availability every this many bytes encoded
    verify_crc: bool = True                 # receiver checks CRC-32C before a block is visible
    # the prefill assembles the KV it ships in a lease of this pool (sent without a copy); when the
    # pool is full it builds in ordinary memory and the send copies (counted: kv_send_pool_full)
    build_into_pool: bool = True
    require_grant: bool = False             # accept only transfers announced by expect() (the cluster: True)
    backends: tuple[str, ...] = ("UCX",)
    # UCX error handling: "peer" detects a dead peer but forces notifications over tcp (shared memory
    # has no failure detection); "none" sends them over shared memory on one host (~10% faster at
    # 180 MiB, measured) and relies on our timeouts alone for a dead peer
    ucx_error_handling: str = "peer"
    # the pool's first bytes touched at start (capped at pool_bytes), so the first requests do not
    # fault its pages in on their path (179 MB: 0.72 s cold vs 0.011 s warm, measured); RSS at once
    prefault_bytes: int = 512 << 20

    def __post_init__(self):
        if self.pool_bytes <= 0 or self.max_block_bytes <= 0 or self.inbox_bytes <= 0:
            raise ValueError("pool_bytes, max_block_bytes and inbox_bytes must be positive")
        if not isinstance(self.prefault_bytes, int) or self.prefault_bytes < 0:
            raise ValueError("prefault_bytes must be an integer >= 0")
        if (self.read_piece_bytes <= 0 or self.stream_piece_bytes <= 0
                or not 0 < self.busy_poll_s <= self.expect_poll_s <= self.idle_poll_s):
            raise ValueError("need read_piece_bytes, stream_piece_bytes > 0 and "
                             "0 < busy_poll_s <= expect_poll_s <= idle_poll_s")
        if self.ucx_error_handling not in ("peer", "none"):
            raise ValueError(f"ucx_error_handling must be 'peer' or 'none', not {self.ucx_error_handling!r}")


class NixlTransport(NixlSender, NixlReader, KVTransport):
    """Both ends over one NIXL agent. Receiver: give :meth:`metadata` (and :attr:`name`, the
    address senders use) to senders; then :meth:`receive`. Sender: :meth:`add_peer`, then
    :meth:`send`. Starts the agent, registers the pool and starts the progress thread."""

    def __init__(self, cfg: NixlTransportConfig = NixlTransportConfig(), *, model: str | None = None,
                 name: str | None = None, inbox: Inbox | None = None):
        from nixl._api import nixl_agent, nixl_agent_config        # lazy: only this backend needs NIXL
        self.cfg, self.model = cfg, model
        self.name = name or f"kvnotes-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        for b in cfg.backends:
            self._agent.create_backend(b, {"ucx_error_handling_mode": cfg.ucx_error_handling} if b == "UCX" else {})
        self._lock = threading.RLock()                              # every agent call
        self._pool = BufferPool(cfg.pool_bytes, prefault_bytes=min(cfg.prefault_bytes, cfg.pool_bytes))
        self._reg = self._agent.register_memory([(self._pool.address, cfg.pool_bytes, 0, "")], "DRAM")
        self._inbox = inbox or Inbox(cfg.inbox_bytes, cfg.max_block_bytes, cfg.unclaimed_ttl_s,
                                     require_grant=cfg.require_grant)
        self._peers: set[str] = set()                               # agents whose metadata is loaded
        self._introduced: set[str] = set()                          # peers sent our metadata
        self._out: dict[str, _Outgoing] = {}                        # transfer id -> open send
        self._quarantine: dict[str, _Outgoing] = {}                 # timed-out send -> staging kept until PULLED/TTL
        self._out_lock = threading.Lock()  # guards _out and _quarantine
        # receiver side, progress thread only: streamed offers' announced bytes (tid -> Avail), and
        # notifications that arrived while a streamed READ waited (dispatched after it)
        self._avail: collections.OrderedDict[str, Avail] = collections.OrderedDict()
        self._deferred: collections.deque = collections.deque()
        self.counters: collections.Counter[str] = collections.Counter()  # fallback/failure kind -> count
        self._stop = threading.Event()
        self._wake = threading.Event()                              # a send or a grant: poll now
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="nixl-crc")  # both sides' CRC-32C, in order
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

    # ---- sending: kvtransport.transfer.nixl_send.NixlSender (send, send_kv, lease) -------------------

    # ---- receiving -----------------------------------------------------------------------------
    def receive(self, transfer_id: str, *, timeout: float = 30.0) -> KVBlock:
        """Claim a verified block (see :class:`KVTransport`). Its payload leases pool memory until
        the block and every tensor decoded from it are dropped."""
        return self._inbox.claim(transfer_id, timeout)

    def state(self, transfer_id: str) -> TransferState:
        return self._inbox.state(transfer_id)

    def expect(self, grant) -> None:  # announce a transfer (see Inbox.expect); polls faster until it arrives
        self._inbox.expect(grant)
        self._wake.set()

    stats = lambda self: self._inbox.stats()  # noqa: E731 -- InboxStats: held bytes, expiries, refusals
    pool = property(lambda self: self._pool, doc="the registered arena (staging + received blocks)")
    kind = "nixl"

    def stop(self) -> None:  # stop the progress thread, deregister the pool; idempotent, joins the thread
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        self._crc_pool.shutdown(wait=True)
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
                for peer, msgs in notifs.items():       # queued: a streamed READ applies the batch's AVAILs
                    peer = peer.decode() if isinstance(peer, bytes) else peer
                    self._deferred.extend((peer, bytes(msg)) for msg in msgs)
                while self._deferred:
                    self._dispatch(*self._deferred.popleft())
            except Exception:  # the thread must survive anything a peer sends; counted, logged
                self.counters["progress_error"] += 1
                log.exception("NIXL progress loop error in %s", self.name)
                notifs = {}
            if time.monotonic() - last_sweep > 1.0:
                last_sweep = time.monotonic()
                self._sweep()
            busy = bool(notifs) or bool(self._out)
            cap = self.cfg.expect_poll_s if self._inbox.expecting() else self.cfg.idle_poll_s
            delay = self.cfg.busy_poll_s if busy else min(cap, delay * 2)
            self._wake.wait(delay)
            self._wake.clear()

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._out_lock:
            for tid in [t for t, o in self._quarantine.items() if now - o.since > self.cfg.unclaimed_ttl_s]:
                self._quarantine.pop(tid).staging = None
        self._inbox.stats()                                        # runs the inbox's expiry

    def _dispatch(self, peer: str, msg: bytes) -> None:
        kind, body = msg[:1], msg[1:]
        if kind == AVAIL:
            try:
                a = Avail.decode(msg)
            except (ValueError, UnicodeDecodeError) as exc:
                self.counters["bad_notification"] += 1
                log.warning("malformed NIXL availability from %s dropped: %s", peer, exc)
                return
            self._avail[a.transfer_id] = a
            self._avail.move_to_end(a.transfer_id)
            while len(self._avail) > 1024:                 # left by refused or abandoned streams
                self._avail.popitem(last=False)
        elif kind in (OFFER, STREAM):
            try:
                offer = Offer.decode(msg)
            except ValueError as exc:
                self.counters["bad_offer"] += 1
                log.warning("malformed NIXL offer from %s dropped: %s", peer, exc)
                return
            self._on_offer(peer, offer)
        elif kind in (PULLED, REPLY):
            reply = Reply.decode(msg) if kind == REPLY else None
            tid = reply.transfer_id if reply else body.decode()
            with self._out_lock:
                out = self._out.get(tid) or self._quarantine.pop(tid, None)
            if out is None:                                        # PULLED may trail the REPLY: harmless
                if reply is not None:
                    self.counters["late_reply"] += 1
                    log.info("NIXL reply for closed transfer %s from %s", shown_id(tid), peer)
                return
            out.staging = None                                     # pulled (or refused): staging is free
            if reply is not None:
                out.reply = reply
                out.done.set()
        elif kind == CANCEL:                   # only the peer that pushes a transfer may cancel it
            tid = body.decode(errors="replace")
            if self._inbox.abort(tid, f"cancelled by sender {peer}", peer=peer):
                self._avail.pop(tid, None)
        else:
            self.counters["bad_notification"] += 1
            log.warning("unknown NIXL notification %r from %s dropped", msg[:16], peer)

    def _on_offer(self, peer: str, offer: Offer) -> None:
        h, tid = offer.header, offer.header.transfer_id
        if peer not in self._peers:
            try:
                self.add_peer(peer, offer.metadata)
            except Exception as exc:  # cannot pull nor answer without its metadata; the sender times out
                self.counters["unknown_peer"] += 1
                log.warning("NIXL offer %s from %s without usable metadata dropped: %s", shown_id(tid), peer, exc)
                return
        try:
            layout = self._inbox.begin(tid, h.payload_bytes, h, peer=peer)
        except TransferError as exc:
            return self._notify(peer, Reply(tid[:MAX_TRANSFER_ID], False, exc.reason, str(exc)))
        try:
            h.check(model=self.model, payload_bytes=offer.nbytes)
        except BlockError as exc:
            return self._fail(peer, tid, "rejected", str(exc))
        dest = self._pool.lease(offer.nbytes if layout is None else layout.nbytes)
        if dest is None:
            self.counters["pool_full"] += 1
            return self._fail(peer, tid, "backpressure", f"NIXL receive pool full ({self._pool.leased_bytes} leased)")
        try:
            state, crc = self._read(peer, dest, offer, PULLED + tid.encode(), layout)
        except Exception as exc:  # a NIXL/UCX error fails this transfer only; counted, logged
            state, crc = f"ERR ({type(exc).__name__}: {exc})", None
        if state != "DONE":
            self.counters["nixl_error"] += 1
            return self._fail(peer, tid, "nixl_error", f"NIXL READ of {tid} from {peer}: {state}")
        if offer.streamed:                                 # the checksum came last, with the final bytes
            final = self._avail.pop(tid, None)
            if final is None or final.ready != offer.nbytes:
                return self._fail(peer, tid, "rejected", f"streamed block {tid} ended without its checksum")
            h = dataclasses.replace(h, checksum=final.crc)
        if crc is not None and crc != h.checksum:
            return self._fail(peer, tid, "rejected", f"checksum mismatch on {tid}: header {h.checksum:#010x}, "
                                                     f"payload {crc:#010x}")
        payload = memoryview(dest)
        self._inbox.finish(tid, KVBlock.verified(h, payload, layout) if crc is not None
                           else KVBlock(h, payload, layout=layout))
        self._notify(peer, Reply(tid, True))

    def _fail(self, peer: str, tid: str, reason: str, error: str) -> None:
        log.warning("rejected NIXL KV block %s from %s: %s", shown_id(tid), peer, error)
        self._avail.pop(tid, None)
        self._inbox.finish(tid, None, error)
        self._notify(peer, Reply(tid, False, reason, error))
