"""The chosen transport, both ends: what a decode worker receives on and what a prefill worker
sends with, picked by config ``kv_transport: auto | nixl | grpc``.

- :class:`Receiver` (decode side): one :class:`~kvtransport.transfer.inbox.Inbox` that accepts only
  granted transfers (``require_grant``), fed by a gRPC server (always: the portable path and the
  fallback) and, for ``nixl``/``auto``, a NIXL agent. The gRPC server binds the node's address
  (or all interfaces) and advertises the node's address, so senders on other nodes reach it.
  Its :attr:`Receiver.endpoint` (a :class:`~kvruntime.messages.transfer.KVEndpoint`, NIXL agent
  metadata included) travels to prefill workers through the Ray actors.
- :class:`Sender` (prefill side, the shipped
  :class:`~kvtransport.transfer.interface.KVSender`): encodes the block in the decode engine's
  dtype, with the transfer's credential in its header, and sends it, returning a ``SendResult``;
  over gRPC streamed (``GrpcTransport.send_kv``: CRC-32C'd chunk by chunk, or unchecked to a decode worker on the
  same host under ``checksum: auto``); over NIXL pipelined
  (``NixlTransport.send_kv``: the receiver READs the pieces already in registered memory while
  the next is prepared). KV the prefill built in the sender's registered pool (:meth:`Sender.alloc`,
  used when :meth:`Sender.builds_into_pool` says so) is sent without a copy; other KV is copied,
  cast to the wire dtype in the same pass, into the pool piece by piece.
- :class:`BlockKVSender`: a ``KVSender`` over one block transport (``GrpcTransport``,
  ``NixlTransport``) to an address, for tests and benches that run one transport alone.

``auto`` = NIXL where it imports and starts, else gRPC; ``nixl`` = NIXL or refuse to start.
A fall back from NIXL to gRPC (NIXL unavailable at start, or a peer NIXL cannot reach) is
returned as a fallback reason (``kv_transport_nixl_unavailable``, ``kv_transport_nixl_to_grpc``)
that the router counts in ``kvnotes_fallbacks_total`` and is logged once per process and reason.
"""
from __future__ import annotations

import logging
import time

import torch

from kvruntime.config.choices import TransportKind
from kvruntime.kv import KVCache
from kvruntime.messages.transfer import KVEndpoint, TransferGrant
from kvruntime.telemetry import log_fallback_once
from kvtransport.transfer.blocks import DTYPES, KVBlock, block_header, encode_block, wire_header
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.inbox import Inbox, InboxStats
from kvtransport.transfer.interface import BlockSender, KVReceiver, KVSender, SendResult, TransferError

log = logging.getLogger(__name__)

#: NIXL send failures after which the block is pushed over gRPC instead (nothing reached the receiver's inbox)
_NIXL_RETRY_OVER_GRPC = ("unknown_peer", "unavailable")


def _start_nixl(kind: str, cfg=None, require_grant: bool = False, **kw):
    """(NixlTransport, None), or (None, fallback reason) under ``auto``; ``nixl`` raises RuntimeError."""
    try:
        from kvtransport.transfer.nixl_transport import NixlTransport, NixlTransportConfig
        return NixlTransport(cfg or NixlTransportConfig(require_grant=require_grant), **kw), None
    except Exception as exc:  # ImportError, or NIXL/UCX failing to start: auto falls back, counted + logged
        if kind == "nixl":
            raise RuntimeError(f"kv_transport is 'nixl' but NIXL cannot start: {exc}") from exc
        log_fallback_once(log, "kv_transport_nixl_unavailable", "NIXL unavailable (%s): KV blocks travel over gRPC",
                          exc)
        return None, "kv_transport_nixl_unavailable"


class Receiver(KVReceiver):
    """The decode worker's side. ``bind``: interface address for the gRPC server (``0.0.0.0`` =
    all); ``advertise``: the address senders use (the node's address as Ray reports it)."""

    def __init__(self, kind: TransportKind, model: str, dtype: str, *, bind: str = "0.0.0.0", advertise: str = "127.0.0.1",
                 node_id: str = "", grpc_cfg: GrpcTransportConfig | None = None, nixl_cfg=None):
        kind = TransportKind.of(kind)
        gcfg = grpc_cfg or GrpcTransportConfig(require_grant=True)
        self.inbox = Inbox(gcfg.inbox_bytes, gcfg.max_block_bytes, gcfg.unclaimed_ttl_s,
                           require_grant=gcfg.require_grant)
        self.grpc = GrpcTransport(gcfg, model=model, inbox=self.inbox)
        address = self.grpc.serve(bind, 0, advertise=advertise)
        self.nixl, self.fallback = None, None
        if kind != "grpc":
            self.nixl, self.fallback = _start_nixl(kind, nixl_cfg, gcfg.require_grant, model=model, inbox=self.inbox)
        n = self.nixl
        self.endpoint = KVEndpoint("nixl" if n else "grpc", address, dtype, node_id,
                                   n.name if n else "", n.metadata() if n else b"")

    def expect(self, grant: TransferGrant) -> None:
        if self.nixl is not None:
            self.nixl.expect(grant)           # the same inbox; wakes NIXL's progress thread
        else:
            self.inbox.expect(grant)

    def receive(self, transfer_id: str, *, timeout: float = 30.0) -> KVBlock:
        return self.inbox.claim(transfer_id, timeout)

    def stats(self) -> InboxStats:
        return self.inbox.stats()

    def stop(self) -> None:
        self.grpc.stop()
        if self.nixl is not None:
            self.nixl.stop()


class Sender(KVSender):
    """The prefill worker's side: one gRPC client and (``auto``/``nixl``) one NIXL agent."""

    def __init__(self, kind: TransportKind, nixl_cfg=None, grpc_cfg: GrpcTransportConfig | None = None):
        self.kind = kind = TransportKind.of(kind)
        self.grpc = GrpcTransport(grpc_cfg or GrpcTransportConfig())
        self.nixl, self.fallback = None, None
        if kind != "grpc":
            self.nixl, self.fallback = _start_nixl(kind, nixl_cfg)

    def _nixl_peer(self, ep: KVEndpoint) -> str | None:
        if ep.transport != "nixl" or self.nixl is None or not ep.nixl_agent:
            return None
        try:
            return self.nixl.add_peer(ep.nixl_agent, ep.nixl_metadata)
        except ValueError as exc:
            log_fallback_once(log, "kv_transport_nixl_to_grpc", "NIXL peer %s unusable (%s): sending over gRPC",
                              ep.nixl_agent, exc)
            return None

    def send(self, to: KVEndpoint, transfer_id: str, model: str, kv: KVCache, *, credential: str,
             timeout: float) -> SendResult:
        """Encode ``kv`` in ``to.dtype`` and push it: over NIXL when both ends run it, else (or
        when NIXL cannot reach the peer) over gRPC, the fall back in the result's ``fallbacks``.
        Raises :class:`TransferError` when the block did not arrive."""
        if not isinstance(to, KVEndpoint):
            raise TypeError(f"a Sender sends to a KVEndpoint, got {type(to).__name__}")
        fallbacks: list[str] = []
        peer = None
        if self.kind != "grpc":
            if to.transport != "nixl" or self.nixl is None:
                fallbacks.append("kv_transport_nixl_unavailable")   # this sender or that receiver runs gRPC only
            elif (peer := self._nixl_peer(to)) is None:
                fallbacks.append("kv_transport_nixl_to_grpc")
        if peer is not None and kv.num_tokens:
            try:
                return self._send_nixl(peer, to, transfer_id, model, kv, credential, timeout, fallbacks)
            except TransferError as exc:
                if exc.reason not in _NIXL_RETRY_OVER_GRPC:
                    raise
                log_fallback_once(log, "kv_transport_nixl_to_grpc", "NIXL send to %s failed (%s): sending over gRPC",
                                  peer, exc)
                fallbacks.append("kv_transport_nixl_to_grpc")
        t = time.perf_counter()
        header, payload = block_header(transfer_id, model, kv, dtype=to.dtype, credential=credential)
        stages = {"serialise": time.perf_counter() - t}
        receipt = self.grpc.send_kv(to.grpc_address, header, payload, timeout=timeout)
        if receipt.fallback:                  # e.g. the receiver wanted a checksum the same-host send skipped
            fallbacks.append(receipt.fallback)
        stages["transfer"] = receipt.seconds
        return SendResult(receipt, "grpc", stages, tuple(fallbacks))

    def _send_nixl(self, peer: str, to: KVEndpoint, transfer_id: str, model: str, kv: KVCache, credential: str,
                   timeout: float, fallbacks: list[str]) -> SendResult:
        t = time.perf_counter()
        header = wire_header(transfer_id, model, kv, dtype=to.dtype, credential=credential)
        stages = {"serialise": time.perf_counter() - t}
        # zero copy if kv.data lives in the NIXL pool, else copied (+ cast) into it, overlapping the READ
        receipt = self.nixl.send_kv(peer, header, kv.data, timeout=timeout)
        stages["transfer"] = receipt.seconds
        return SendResult(receipt, "nixl", stages, tuple(fallbacks))

    def builds_into_pool(self, to: KVEndpoint, dtype: torch.dtype) -> bool:
        """Whether KV of ``dtype`` for ``to`` should be assembled in :meth:`alloc` memory: NIXL on
        both ends, ``build_into_pool`` on, and ``dtype`` already the wire dtype (else the send
        casts into the pool anyway, in one pass)."""
        return (isinstance(to, KVEndpoint) and self.nixl is not None and self.nixl.cfg.build_into_pool
                and to.transport == "nixl" and bool(to.nixl_agent) and DTYPES.get(to.dtype) == dtype)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised CPU tensor in the NIXL registered pool: KV built there is sent without
        a copy. Released when its last view is dropped. None without NIXL or when the pool is
        full (the caller builds in ordinary memory; the executor counts ``kv_send_pool_full``)."""
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        buf = self.nixl.lease(nbytes) if self.nixl is not None and nbytes else None
        return None if buf is None else torch.from_numpy(buf).view(dtype).view(shape)

    def stop(self) -> None:
        self.grpc.stop()
        if self.nixl is not None:
            self.nixl.stop()


class BlockKVSender(KVSender):
    """Ships the KV as one block (``encode_block``: the KV's own dtype, CRC-32C) through one
    block transport (a :class:`~kvtransport.transfer.interface.BlockSender`: ``GrpcTransport``,
    ``NixlTransport``) to an address: tests and benches that run one transport without the
    cluster's endpoints. ``to``: a :class:`KVEndpoint` (its ``grpc_address``) or an address."""

    def __init__(self, blocks: BlockSender):
        self.blocks = blocks

    def send(self, to, transfer_id: str, model: str, kv: KVCache, *, credential: str, timeout: float) -> SendResult:
        address = to.grpc_address if isinstance(to, KVEndpoint) else str(to)
        t = time.perf_counter()
        block = encode_block(transfer_id, model, kv, credential=credential)
        stages = {"serialise": time.perf_counter() - t}
        receipt = self.blocks.send(address, block, timeout=timeout)
        stages["transfer"] = receipt.seconds
        return SendResult(receipt, self.blocks.kind, stages, (receipt.fallback,) if receipt.fallback else ())

    def stop(self) -> None:
        self.blocks.stop()
