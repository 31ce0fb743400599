"""The chosen transport, both ends: what a decode worker receives on and what a prefill worker
sends with, picked by config ``kv_transport: auto | nixl | grpc``.

- :class:`Receiver` (decode side): one :class:`~kvtransport.transfer.inbox.Inbox` that accepts only
  granted transfers (``require_grant``), fed by a gRPC server (always: the portable path and the
  fallback) and, for ``nixl``/``auto``, a NIXL agent. The gRPC server binds the node's address
  (or all interfaces) and advertises the node's address, so senders on other nodes reach it.
  Its :attr:`Receiver.endpoint` (a :class:`~kvruntime.messages.transfer.KVEndpoint`, NIXL agent
  metadata included) travels to prefill workers through the Ray actors.
- :class:`Sender` (prefill side): encodes the block in the decode engine's dtype, with the
  transfer's credential in its header, and sends it; over gRPC streamed
  (``GrpcTransport.send_kv``: CRC-32C'd chunk by chunk, or unchecked to a decode worker on the
  same host under ``checksum: auto``); over NIXL pipelined
  (``NixlTransport.send_kv``: the receiver READs the pieces already in registered memory while
  the next is prepared). KV the prefill built in the sender's registered pool (:meth:`Sender.alloc`,
  used when :meth:`Sender.builds_into_pool` says so) is sent without a copy; other KV is copied,
  cast to the wire dtype in the same pass, into the pool piece by piece.

``auto`` = NIXL where it imports and starts, else gRPC; ``nixl`` = NIXL or refuse to start.
A fall back from NIXL to gRPC (NIXL unavailable at start, or a peer NIXL cannot reach) is
returned as a fallback reason (``kv_transport_nixl_unavailable``, ``kv_transport_nixl_to_grpc``)
that the router counts in ``kvnotes_fallbacks_total`` and is logged once per process and reason.
"""
from __future__ import annotations

import logging
import time

import torch

from kvruntime.kv import KVCache
from kvruntime.messages.transfer import KVEndpoint, TransferGrant
from kvruntime.telemetry import log_fallback_once
from kvtransport.transfer.blocks import DTYPES, KVBlock, block_header, wire_header
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.inbox import Inbox, InboxStats
from kvtransport.transfer.interface import KVReceiver, TransferError, TransferReceipt

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

    def __init__(self, kind: str, model: str, dtype: str, *, bind: str = "0.0.0.0", advertise: str = "127.0.0.1",
                 node_id: str = "", grpc_cfg: GrpcTransportConfig | None = None, nixl_cfg=None):
        if kind not in ("auto", "nixl", "grpc"):
            raise ValueError(f"kv_transport must be auto, nixl or grpc, got {kind!r}")
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


class Sender:
    """The prefill worker's side: one gRPC client and (``auto``/``nixl``) one NIXL agent."""

    def __init__(self, kind: str, nixl_cfg=None, grpc_cfg: GrpcTransportConfig | None = None):
        if kind not in ("auto", "nixl", "grpc"):
            raise ValueError(f"kv_transport must be auto, nixl or grpc, got {kind!r}")
        self.kind = kind
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

    def send(self, ep: KVEndpoint, transfer_id: str, model: str, kv: KVCache, *, credential: str,
             timeout: float) -> tuple[TransferReceipt, str, dict[str, float], list[str]]:
        """Encode ``kv`` in ``ep.dtype`` and push it. Returns the receipt, the transport that
        carried it, stage seconds (``serialise``, ``transfer``) and fallback reasons taken.
        Raises :class:`TransferError` when the block did not arrive."""
        fallbacks: list[str] = []
        peer = None
        if self.kind != "grpc":
            if ep.transport != "nixl" or self.nixl is None:
                fallbacks.append("kv_transport_nixl_unavailable")   # this sender or that receiver runs gRPC only
            elif (peer := self._nixl_peer(ep)) is None:
                fallbacks.append("kv_transport_nixl_to_grpc")
        if peer is not None and kv.num_tokens:
            t = time.perf_counter()
            header = wire_header(transfer_id, model, kv, dtype=ep.dtype, credential=credential)
            stages = {"serialise": time.perf_counter() - t}
            try:    # zero copy if kv.data lives in the NIXL pool, else copied (+ cast) into it, overlapping the READ
                receipt = self.nixl.send_kv(peer, header, kv.data, timeout=timeout)
                stages["transfer"] = receipt.seconds
                return receipt, "nixl", stages, fallbacks
            except TransferError as exc:
                if exc.reason not in _NIXL_RETRY_OVER_GRPC:
                    raise
                log_fallback_once(log, "kv_transport_nixl_to_grpc", "NIXL send to %s failed (%s): sending over gRPC",
                                  peer, exc)
                fallbacks.append("kv_transport_nixl_to_grpc")
        t = time.perf_counter()
        header, payload = block_header(transfer_id, model, kv, dtype=ep.dtype, credential=credential)
        stages = {"serialise": time.perf_counter() - t}
        receipt = self.grpc.send_kv(ep.grpc_address, header, payload, timeout=timeout)
        if receipt.fallback:                  # e.g. the receiver wanted a checksum the same-host send skipped
            fallbacks.append(receipt.fallback)
        stages["transfer"] = receipt.seconds
        return receipt, "grpc", stages, fallbacks

    def builds_into_pool(self, ep: KVEndpoint, dtype: torch.dtype) -> bool:
        """Whether KV of ``dtype`` for ``ep`` should be assembled in :meth:`alloc` memory: NIXL on
        both ends, ``build_into_pool`` on, and ``dtype`` already the wire dtype (else the send
        casts into the pool anyway, in one pass)."""
        return (self.nixl is not None and self.nixl.cfg.build_into_pool and ep.transport == "nixl"
                and bool(ep.nixl_agent) and DTYPES.get(ep.dtype) == dtype)

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
