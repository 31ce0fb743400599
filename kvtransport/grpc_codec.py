"""The one codec between :class:`KVBlock` and the gRPC wire messages (protobuf stays here)."""
from __future__ import annotations

from typing import Iterator

from kvtransport.blocks import KVBlock, KVBlockHeader
from kvtransport.proto import kvtransfer_pb2 as pb


def header_to_pb(h: KVBlockHeader, chunk_bytes: int) -> pb.BlockHeader:
    return pb.BlockHeader(transfer_id=h.transfer_id, model=h.model, num_layers=h.num_layers, kv_heads=h.kv_heads,
                          head_dim=h.head_dim, dtype=h.dtype, positions=list(h.positions),
                          token_ids=list(h.token_ids), payload_bytes=h.payload_bytes, checksum=h.checksum,
                          chunk_bytes=chunk_bytes)


def header_from_pb(m: pb.BlockHeader) -> KVBlockHeader:
    return KVBlockHeader(m.transfer_id, m.model, m.num_layers, m.kv_heads, m.head_dim, m.dtype,
                         tuple(m.positions), tuple(m.token_ids), m.payload_bytes, m.checksum)


def block_to_chunks(block: KVBlock, chunk_bytes: int) -> Iterator[pb.PushChunk]:
    """Header first, then the payload in pieces of at most ``chunk_bytes``."""
    yield pb.PushChunk(header=header_to_pb(block.header, chunk_bytes))
    view = memoryview(block.payload)
    for s in range(0, len(view), chunk_bytes):
        yield pb.PushChunk(payload=bytes(view[s:s + chunk_bytes]))


def ack(transfer_id: str, ok: bool, error: str = "", received: int = 0) -> pb.PushAck:
    return pb.PushAck(transfer_id=transfer_id, ok=ok, error=error, bytes_received=received)
