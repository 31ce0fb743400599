"""The transport seam: how a KV block gets from a prefill worker to a decode worker.

gRPC (``grpc_transport``) is the default and the one tested across processes. NIXL (GPU RDMA)
is a later backend: it fills the same two methods.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvtransport.blocks import KVBlock


class TransferState(str, enum.Enum):
    PENDING = "pending"            # announced (header seen), no payload yet
    TRANSFERRING = "transferring"  # payload arriving
    DONE = "done"                  # verified and waiting to be claimed
    FAILED = "failed"              # rejected (checksum, size, model, deadline); error says why
    ABORTED = "aborted"            # cancelled by the sender or expired unclaimed


class TransferError(RuntimeError):
    """A transfer that did not complete; ``reason`` is a short metrics label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TransferReceipt:
    transfer_id: str
    bytes_sent: int
    seconds: float


class KVTransport(ABC):
    @abstractmethod
    def send(self, address: str, block: KVBlock, *, timeout: float) -> TransferReceipt:
        """Deliver ``block`` to the receiver at ``address``. Blocks until the receiver has
        verified it (or raises :class:`TransferError`)."""

    @abstractmethod
    def receive(self, transfer_id: str, *, timeout: float) -> KVBlock:
        """Claim the verified block ``transfer_id`` delivered to this receiver, waiting up to
        ``timeout`` seconds. Removes it from the inbox. Raises :class:`TransferError`."""
