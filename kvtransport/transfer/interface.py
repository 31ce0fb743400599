"""The transfer interface: how a prefix's KV gets from a prefill worker to a decode worker.

Two levels, each a role:

- :class:`KVSender`: what the prefill executor ships with. ``send(to, transfer_id, model, kv)``
  pushes a composed prefix to a decode worker's endpoint and returns a :class:`SendResult`
  (the receipt, the transport that carried it, stage seconds, fallbacks taken); ``alloc`` /
  ``builds_into_pool`` let the build assemble the KV in the sender's registered memory. The
  shipped one is :class:`~kvtransport.transfer.endpoints.Sender` (NIXL or gRPC by
  ``kv_transport``); :class:`~kvtransport.transfer.endpoints.BlockKVSender` ships through one
  block transport (tests, benches); test doubles subclass this class too.
- :class:`BlockSender` (``send(address, block)``) and :class:`KVReceiver` (``receive``): one
  encoded :class:`~kvtransport.transfer.blocks.KVBlock` pushed to, and claimed from, an inbox.
  :class:`KVTransport` is both; gRPC (``grpc_transport``, portable, the default) and NIXL
  (``nixl_transport``, registered memory, UCX; imported lazily) implement it. The decode
  worker's :class:`~kvtransport.transfer.endpoints.Receiver` is only a :class:`KVReceiver`: no
  class here inherits a method it would have to refuse.

Also the words both sides share: :class:`TransferState`, :class:`TransferError` (with its
metrics label) and :class:`TransferReceipt`. Where blocks land: ``inbox`` (the bounded
:class:`~kvtransport.transfer.inbox.Inbox`) and ``buffer_pool`` (the arena receivers lease from).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SendResult:
    """What :meth:`KVSender.send` delivered: the receiver's receipt, the transport that carried
    the block (``nixl`` | ``grpc``), seconds per stage (``serialise``, ``transfer``; the keys of
    ``kvruntime.messages.transfer.STAGES``) and the fallback reasons taken on the way (the
    router counts each in ``kvnotes_fallbacks_total``)."""
    receipt: TransferReceipt
    transport: str
    stages: dict[str, float] = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()


class KVSender(ABC):
    """The prefill side: ships a composed prefix to a decode worker."""

    @abstractmethod
    def send(self, to, transfer_id: str, model: str, kv, *, credential: str, timeout: float) -> SendResult:
        """Push ``kv`` (a :class:`~kvruntime.kv.KVCache`) as transfer ``transfer_id`` of ``model`` to
        the decode worker ``to`` (its :class:`~kvruntime.messages.transfer.KVEndpoint`), with the
        transfer's ``credential`` in the block header. Blocks until the receiver has verified it;
        raises :class:`TransferError` when it did not arrive."""

    def builds_into_pool(self, to, dtype) -> bool:
        """Whether KV of torch ``dtype`` for ``to`` should be built in :meth:`alloc` memory (it
        then ships without a copy). Default: no registered memory."""
        return False

    def alloc(self, shape: tuple[int, ...], dtype):
        """An uninitialised CPU tensor of ``shape`` in registered memory, or None (no room / none)."""
        return None

    def stop(self) -> None:
        """Release sockets, threads and registered memory. Idempotent."""


class BlockSender(ABC):
    """Pushes one encoded block to an inbox (the block transports' sending role)."""

    kind: str = ""              # the transport's name (grpc | nixl), reported as the one that carried a block

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


class KVTransport(BlockSender, KVReceiver):
    """Both block roles in one object: a transport that serves an inbox and sends to other ones."""
