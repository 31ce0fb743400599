"""The one codec between :class:`KVBlock` headers/payload pieces and the wire messages of
``proto/kvtransfer.proto`` (protobuf stays here; the NIXL transport reuses the header codec).

Payload messages are framed by hand, byte-identical to ``PushChunk(payload=...)`` (field 2,
length-delimited), so that a chunk costs exactly one copy (slice of the block's buffer -> the
``bytes`` object gRPC's Python API requires) and is parsed without copying (a memoryview past
the field prefix). Anything else falls back to the generated protobuf parser.
"""
from __future__ import annotations

from typing import Iterator

from kvtransport.blocks import KVBlock, KVBlockHeader
from kvtransport.proto import kvtransfer_pb2 as pb

_PAYLOAD_TAG = 0x12                  # field 2 (payload), wire type 2 (length-delimited)
_HEADER_TAG = 0x0A                   # field 1 (header), wire type 2


def header_to_pb(h: KVBlockHeader, chunk_bytes: int) -> pb.BlockHeader:
    return pb.BlockHeader(transfer_id=h.transfer_id, model=h.model, num_layers=h.num_layers, kv_heads=h.kv_heads,
                          head_dim=h.head_dim, dtype=h.dtype, positions=list(h.positions),
                          token_ids=list(h.token_ids), payload_bytes=h.payload_bytes, checksum=h.checksum,
                          chunk_bytes=chunk_bytes, credential=h.credential)


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


def block_to_chunks(block: KVBlock, chunk_bytes: int) -> Iterator[pb.PushChunk]:
    """The same stream as protobuf objects (for the generated stub; slower: two more copies)."""
    yield pb.PushChunk(header=header_to_pb(block.header, chunk_bytes))
    view = memoryview(block.payload).cast("B")
    for s in range(0, len(view), chunk_bytes):
        yield pb.PushChunk(payload=bytes(view[s:s + chunk_bytes]))


def parse_message(data: bytes) -> KVBlockHeader | memoryview | None:
    """One received ``PushChunk``: a header, a zero-copy payload view, or None (empty message).
    Raises ``ValueError`` for bytes that are neither."""
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
        return header_from_pb(msg.header)
    if kind == "payload":
        return memoryview(msg.payload)
    return None


def ack(transfer_id: str, ok: bool, error: str = "", received: int = 0) -> pb.PushAck:
    return pb.PushAck(transfer_id=transfer_id, ok=ok, error=error, bytes_received=received)
