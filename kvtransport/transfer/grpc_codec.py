"""The one codec between :class:`KVBlock` headers/payload pieces and the wire messages of
``proto/kvtransfer.proto`` (protobuf stays here; the NIXL transport reuses the header codec).

Payload messages are framed by hand, byte-identical to ``PushChunk(payload=...)`` (field 2,
length-delimited), so that a chunk costs exactly one copy (slice of the block's buffer -> the
``bytes`` object gRPC's Python API requires) and is parsed without copying (a memoryview past
the field prefix). Anything else falls back to the generated protobuf parser.

Two stream shapes: :func:`block_to_messages` (an encoded block: its header carries the CRC-32C)
and :func:`stream_messages` (a streaming sender: the header says ``checksum_last``, each chunk is
CRC'd from the message just built, still in cache, on a :class:`CrcChain`, and the CRC travels
in a final ``PushChunk(checksum=...)``; no separate pass over the payload before the send; or,
without a chain, the header says ``unchecked`` and no CRC is computed or sent: a same-host push,
see :mod:`kvtransport.transfer.same_host`).
"""
from __future__ import annotations

from concurrent.futures import Executor
from typing import Iterator, NamedTuple

import numpy as np

from kvtransport.transfer.blocks import KVBlock, KVBlockHeader, checksum_extend
from kvtransport.transfer.proto import kvtransfer_pb2 as pb

_PAYLOAD_TAG = 0x12                  # field 2 (payload), wire type 2 (length-delimited)
_HEADER_TAG = 0x0A                   # field 1 (header), wire type 2
_CHECKSUM_TAG = 0x1D                 # field 3 (checksum), wire type 5 (fixed32)


class Opening(NamedTuple):
    """A stream's first message: the header, and whether the checksum comes last (then
    ``header.checksum`` is 0 until the :class:`Trailer` arrives) or never (``unchecked``)."""
    header: KVBlockHeader
    checksum_last: bool
    unchecked: bool = False


class Trailer(NamedTuple):
    """A streaming sender's last message: the CRC-32C of the whole payload."""
    checksum: int


class CrcChain:
    """CRC-32C of pieces added in order: on ``executor``'s thread when given (it must run one
    task at a time, in order; libcrc32c releases the GIL, so the CRC of piece k overlaps the
    transfer of piece k+1), else in line. A piece must stay unchanged until :meth:`result`."""

    def __init__(self, executor: Executor | None = None):
        self.crc, self._ex, self._last = 0, executor, None

    def add(self, piece) -> None:
        if self._ex is None:
            self.crc = checksum_extend(self.crc, piece)
        else:
            self._last = self._ex.submit(self._step, piece)

    def _step(self, piece) -> None:
        self.crc = checksum_extend(self.crc, piece)

    def result(self) -> int:
        """The CRC-32C of every piece added (waits for the CRC thread)."""
        if self._last is not None:
            self._last.result()
        return self.crc


def header_to_pb(h: KVBlockHeader, chunk_bytes: int, checksum_last: bool = False,
                 unchecked: bool = False) -> pb.BlockHeader:
    return pb.BlockHeader(transfer_id=h.transfer_id, model=h.model, num_layers=h.num_layers, kv_heads=h.kv_heads,
                          head_dim=h.head_dim, dtype=h.dtype, positions=list(h.positions),
                          token_ids=list(h.token_ids), payload_bytes=h.payload_bytes,
                          checksum=0 if checksum_last or unchecked else h.checksum, chunk_bytes=chunk_bytes,
                          credential=h.credential, checksum_last=checksum_last, unchecked=unchecked)


def header_from_pb(m: pb.BlockHeader) -> KVBlockHeader:
    return KVBlockHeader(m.transfer_id, m.model, m.num_layers, m.kv_heads, m.head_dim, m.dtype,
                         tuple(m.positions), tuple(m.token_ids), m.payload_bytes, m.checksum, m.credential)


def header_to_bytes(h: KVBlockHeader) -> bytes:
    return header_to_pb(h, 0).SerializeToString()


def header_from_bytes(data: bytes) -> KVBlockHeader:
    """Raises ``ValueError`` for bytes that are not a serialized ``BlockHeader``."""
    try:
        return header_from_pb(pb.BlockHeader.FromString(data))
    except Exception as exc:  # protobuf's DecodeError has no stable import path across runtimes
        raise ValueError(f"not a KV block header: {exc}") from None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def block_to_messages(block: KVBlock, chunk_bytes: int) -> Iterator[bytes]:
    """Serialized ``PushChunk`` messages: the header, then the payload in pieces of at most
    ``chunk_bytes``, each one copy of a slice of the payload buffer (no other copies)."""
    yield pb.PushChunk(header=header_to_pb(block.header, chunk_bytes)).SerializeToString()
    view = memoryview(block.payload).cast("B")
    for s in range(0, len(view), chunk_bytes):
        piece = view[s:s + chunk_bytes]
        yield b"".join((bytes((_PAYLOAD_TAG,)), _varint(len(piece)), piece))


def stream_messages(header: KVBlockHeader, payload, chunk_bytes: int, chain: CrcChain | None) -> Iterator[bytes]:
    """Serialized ``PushChunk`` messages for a streaming sender: the header (``checksum_last``;
    its own checksum is ignored), the payload in pieces of at most ``chunk_bytes`` (one copy
    each, as :func:`block_to_messages`), each piece CRC'd on ``chain`` from the message just
    built, then the CRC-32C of the payload. ``chain`` None: the header says ``unchecked`` and
    neither a CRC pass nor a checksum message follows (a same-host push)."""
    yield pb.PushChunk(header=header_to_pb(header, chunk_bytes, checksum_last=chain is not None,
                                           unchecked=chain is None)).SerializeToString()
    view = memoryview(payload).cast("B")
    for s in range(0, len(view), chunk_bytes):
        piece = view[s:s + chunk_bytes]
        prefix = bytes((_PAYLOAD_TAG,)) + _varint(len(piece))
        msg = b"".join((prefix, piece))
        if chain is not None:
            chain.add(np.frombuffer(msg, dtype=np.uint8, offset=len(prefix)))
        yield msg
    if chain is not None:
        yield bytes((_CHECKSUM_TAG,)) + chain.result().to_bytes(4, "little")


def block_to_chunks(block: KVBlock, chunk_bytes: int) -> Iterator[pb.PushChunk]:
    """The same stream as protobuf objects (for the generated stub; slower: two more copies)."""
    yield pb.PushChunk(header=header_to_pb(block.header, chunk_bytes))
    view = memoryview(block.payload).cast("B")
    for s in range(0, len(view), chunk_bytes):
        yield pb.PushChunk(payload=bytes(view[s:s + chunk_bytes]))


def parse_message(data: bytes) -> Opening | memoryview | Trailer | None:
    """One received ``PushChunk``: a header (:class:`Opening`), a zero-copy payload view, the
    checksum (:class:`Trailer`), or None (empty message). Raises ``ValueError`` for bytes that
    are none of these."""
    if len(data) > 1 and data[0] == _PAYLOAD_TAG:
        n, shift, i = 0, 0, 1
        while i < len(data) and i < 11:
            b = data[i]
            n |= (b & 0x7F) << shift
            shift += 7
            i += 1
            if not b & 0x80:
                break
        if i + n == len(data):
            return memoryview(data)[i:]
    try:
        msg = pb.PushChunk.FromString(data)
    except Exception as exc:  # see header_from_bytes
        raise ValueError(f"not a PushChunk message: {exc}") from None
    kind = msg.WhichOneof("item")
    if kind == "header":
        return Opening(header_from_pb(msg.header), msg.header.checksum_last, msg.header.unchecked)
    if kind == "payload":
        return memoryview(msg.payload)
    if kind == "checksum":
        return Trailer(msg.checksum)
    return None


def ack(transfer_id: str, ok: bool, error: str = "", received: int = 0) -> pb.PushAck:
    return pb.PushAck(transfer_id=transfer_id, ok=ok, error=error, bytes_received=received)
