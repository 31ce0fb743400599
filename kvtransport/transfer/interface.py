"""The transfer seam: how a KV block gets from a prefill worker to a decode worker, as two roles.

- :class:`KVSender` (``send``): the prefill side pushes a block to a receiver's address.
- :class:`KVReceiver` (``receive``): the decode side claims a verified block by transfer id.
- :class:`KVTransport`: both roles in one object; gRPC (``grpc_transport``, portable, the
  default) and NIXL (``nixl_transport``, registered memory, UCX; imported lazily) implement it.
  The decode worker's :class:`~kvtransport.transfer.endpoints.Receiver` is only a
  :class:`KVReceiver`: no class here inherits a method it would have to refuse.

Also the words both roles share: :class:`TransferState`, :class:`TransferError` (with its
metrics label) and :class:`TransferReceipt`. Where blocks land: ``inbox`` (the bounded
:class:`~kvtransport.transfer.inbox.Inbox`) and ``buffer_pool`` (the arena receivers lease from).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvtransport.transfer.blocks import KVBlock


class TransferState(str, enum.Enum):
    PENDING = "pending"            # announced (header seen), no payload yet
    TRANSFERRING = "transferring"  # payload arriving
    DONE = "done"                  # verified and waiting to be claimed
    FAILED = "failed"              # rejected (checksum, size, model, deadline); error says why
    ABORTED = "aborted"            # cancelled by the sender or expired unclaimed


class TransferError(RuntimeError):
    """A transfer that did not complete; ``reason`` is a short metrics label (``timeout``,
    ``unavailable``, ``backpressure``, ``duplicate``, ``rejected``, ``too_large``, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TransferReceipt:
    transfer_id: str
    bytes_sent: int
    seconds: float
    fallback: str = ""          # a fallback the transport took to deliver it (the caller counts it), or ""


class KVSender(ABC):
    """The sending role (prefill side)."""

    @abstractmethod
    def send(self, address: str, block: KVBlock, *, timeout: float) -> TransferReceipt:
        """Deliver ``block`` to the receiver at ``address``. Blocks until the receiver has
        verified it (or raises :class:`TransferError`)."""

    def stop(self) -> None:
        """Release sockets, threads and registered memory. Idempotent."""


class KVReceiver(ABC):
    """The receiving role (decode side)."""

    @abstractmethod
    def receive(self, transfer_id: str, *, timeout: float) -> KVBlock:
        """Claim the verified block ``transfer_id`` delivered to this receiver, waiting up to
        ``timeout`` seconds. Removes it from the inbox. Raises :class:`TransferError`."""

    def stop(self) -> None:
        """Release sockets, threads and registered memory. Idempotent."""


class KVTransport(KVSender, KVReceiver):
    """Both roles in one object: a transport that serves an inbox and sends to other ones."""
