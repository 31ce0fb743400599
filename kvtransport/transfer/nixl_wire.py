"""The notifications two :class:`~kvtransport.transfer.nixl_transport.NixlTransport` agents exchange
(first byte = kind): ``O`` offer (pull this block, it is all in my registered memory), ``S``
streamed offer (pull it as it becomes available: the sender is still encoding it into its
registered memory), ``A`` available (a streamed offer's first ``ready`` bytes may be read; the
last one, ``ready == nbytes``, carries the payload's CRC-32C), ``P`` pulled (NIXL's own READ
notification: staging can be freed), ``R`` reply (the receiver's verdict), ``C`` cancel.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from kvtransport.transfer.blocks import KVBlockHeader
from kvtransport.transfer.grpc_codec import header_from_bytes, header_to_bytes

OFFER, STREAM, AVAIL, PULLED, REPLY, CANCEL = b"O", b"S", b"A", b"P", b"R", b"C"
_OFFER_FIXED = struct.Struct("<QQIII")      # addr, nbytes, dev_id, len(metadata), len(header)
_AVAIL_FIXED = struct.Struct("<QI")         # ready bytes, CRC-32C of the whole payload (when complete)


@dataclass(frozen=True)
class Offer:
    """Sender -> receiver: pull this block from my registered memory. ``streamed``: only the
    bytes announced by :class:`Avail` are there yet, and ``header.checksum`` is not used (the
    last :class:`Avail` carries it)."""
    header: KVBlockHeader
    addr: int                 # virtual address of the staged payload in the sender's process
    nbytes: int               # staged bytes (the receiver checks them against the header)
    dev_id: int               # NIXL device id of that memory (0 for DRAM)
    metadata: bytes           # the sender's agent metadata on a first offer, else b""
    streamed: bool = False

    def encode(self) -> bytes:
        hdr = header_to_bytes(self.header)
        return b"".join((STREAM if self.streamed else OFFER,
                         _OFFER_FIXED.pack(self.addr, self.nbytes, self.dev_id, len(self.metadata), len(hdr)),
                         self.metadata, hdr))

    @staticmethod
    def decode(msg: bytes) -> "Offer":
        """Raises ``ValueError`` for a malformed offer."""
        n = 1 + _OFFER_FIXED.size
        addr, nbytes, dev, lmd, lhdr = _OFFER_FIXED.unpack_from(msg, 1) if len(msg) >= n else (0, 0, 0, -1, 0)
        if lmd < 0 or len(msg) != n + lmd + lhdr:
            raise ValueError("offer too short or its length does not match its fields")
        return Offer(header_from_bytes(msg[n + lmd:]), addr, nbytes, dev, bytes(msg[n:n + lmd]), msg[:1] == STREAM)


@dataclass(frozen=True)
class Avail:
    """Sender -> receiver, streamed offers: the first ``ready`` bytes are in place."""
    transfer_id: str
    ready: int
    crc: int = 0              # CRC-32C of the whole payload; meaningful once ready == nbytes

    def encode(self) -> bytes:
        return AVAIL + _AVAIL_FIXED.pack(self.ready, self.crc) + self.transfer_id.encode()

    @staticmethod
    def decode(msg: bytes) -> "Avail":
        """Raises ``ValueError`` for a malformed message."""
        if len(msg) < 1 + _AVAIL_FIXED.size:
            raise ValueError("availability notification too short")
        ready, crc = _AVAIL_FIXED.unpack_from(msg, 1)
        return Avail(bytes(msg[1 + _AVAIL_FIXED.size:]).decode(), ready, crc)


@dataclass(frozen=True)
class Reply:
    """Receiver -> sender: the verdict on an offer."""
    transfer_id: str
    ok: bool
    reason: str = ""          # TransferError reason when not ok
    error: str = ""

    def encode(self) -> bytes:
        return REPLY + json.dumps([self.transfer_id, self.ok, self.reason, self.error]).encode()

    @staticmethod
    def decode(msg: bytes) -> "Reply":
        tid, ok, reason, error = json.loads(msg[1:])
        return Reply(str(tid), bool(ok), str(reason), str(error))
