"""NIXL READs a block into the granted room (issue 47 item 3): one descriptor per row segment,
rows ``capacity`` slots apart, the CRC-32C of the plain block checked over the rows in order;
bit-exact, the pool released after the claim. The receiver runs in a child process."""
import dataclasses
import gc

import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import block_header, encode_block
from kvtransport.transfer.nixl_transport import NixlTransport, NixlTransportConfig
from tests.nixl_pair import nixl_pair

CFG = NixlTransportConfig(pool_bytes=64 << 20, max_block_bytes=32 << 20, inbox_bytes=48 << 20,
                          read_piece_bytes=1 << 20, stream_piece_bytes=2 << 20)
LEAD, ROOM = 5, 37


def _kv(tokens, dtype=torch.float32):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(4, 2, 3, tokens, 64, generator=g).to(dtype), torch.arange(LEAD, LEAD + tokens),
                   torch.arange(100, 100 + tokens))


def _receiver(cmds, results):
    """Child: one NixlTransport; ("expect", tid, tokens, dtype), ("receive", tid, tokens, dtype),
    ("leased",), ("stop",); answers ("ok", value) or ("error", message)."""
    from kvtransport.transfer.blocks import block_buffer, decode_block
    t = NixlTransport(CFG, model="m")
    results.put((t.name, t.metadata()))
    while (cmd := cmds.get())[0] != "stop":
        try:
            if cmd[0] == "expect":
                kv = _kv(cmd[2], getattr(torch, cmd[3]))
                grant, _ = TransferGrant.issue(cmd[1], "m", cmd[3], kv.token_ids.tolist(), first_position=LEAD)
                t.expect(dataclasses.replace(grant, room=ROOM))
                results.put(("ok", None))
            elif cmd[0] == "receive":
                block = t.receive(cmd[1], timeout=10)
                got, want, buf = decode_block(block, model="m"), _kv(cmd[2], getattr(torch, cmd[3])), block_buffer(block)
                results.put(("ok", (torch.equal(got.data, want.data), tuple(buf.shape),
                                    got.data.data_ptr() == buf[:, :, :, LEAD:].data_ptr())))
                del block, got, buf
            elif cmd[0] == "leased":
                gc.collect()
                results.put(("ok", (t.pool.leased_bytes, t.stats().held_bytes)))
        except Exception as exc:  # reported to the parent, which asserts on it
            results.put(("error", f"{type(exc).__name__}: {exc}"))
    t.stop()
    results.put(("ok", "stopped"))


@pytest.fixture(scope="module")
def pair():
    yield from nixl_pair(_receiver, CFG)


@pytest.mark.parametrize("tokens,dtype,streamed", [(50, "float32", False), (4000, "float32", False),
                                                   (3000, "bfloat16", True), (4000, "float32", True)])
def test_nixl_reads_into_the_granted_room(pair, tokens, dtype, streamed):
    tx, name, ask = pair
    tid = f"room-{tokens}-{dtype}-{streamed}"
    assert ask("expect", tid, tokens, dtype) == ("ok", None)
    kv = _kv(tokens, getattr(torch, dtype))
    if streamed:                                   # offer first, pieces announced as they are staged
        header, payload = block_header(tid, "m", kv)
        assert tx.send_kv(name, header, payload, timeout=60).bytes_sent == header.payload_bytes
    else:
        assert tx.send(name, encode_block(tid, "m", kv), timeout=60).bytes_sent == kv.data.nbytes
    assert ask("receive", tid, tokens, dtype) == ("ok", (True, (4, 2, 3, LEAD + tokens + ROOM, 64), True))
    assert ask("leased") == ("ok", (0, 0))         # claimed and dropped: the pool and the inbox are free
    gc.collect()
    assert tx.pool.leased_bytes == 0
