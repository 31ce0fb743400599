"""The decode leg at copy speed (issue 47 item 3): a prefix block is received into the buffer the
decode session then runs in -- rows ``capacity`` slots apart, room after them for the suffix and
the generated tokens, the held slots before them -- so the received prefix is never copied. The
wire bytes and their CRC-32C are the plain block's; the tokens and log-probs are bit-equal to the
path that copies the block into a fresh buffer."""
import dataclasses
import uuid

import numpy as np
import pytest
import torch

import decode_workers.executor as executor_mod
from cluster.control.planner import RenderedRequest, TierView, plan_request
from decode_workers.actor import announce
from decode_workers.executor import DecodeExecutor
from decode_workers.held_kv import HeldPrefixes
from kvruntime.decode_cache import DecodeSession
from kvruntime.kv import KVCache
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.plan import Policy
from kvruntime.messages.transfer import TransferExpectation, TransferGrant
from kvtransport.transfer.blocks import (BlockError, KVBlock, SlotLayout, as_bytes_array, block_buffer,
                                         block_header, checksum, decode_block, encode_block, verify)
from kvtransport.transfer.endpoints import Receiver, Sender
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransport.transfer.inbox import Inbox
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource
from tests.test_executors import _segments


def _kv(tokens=50, first=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(tokens)
    return KVCache(torch.randn(4, 2, 3, tokens, 64, generator=g).to(dtype), torch.arange(first, first + tokens),
                   torch.arange(100, 100 + tokens))


@pytest.mark.parametrize("piece", [1000, 4096, 1 << 20])
def test_a_layout_places_rows_apart_and_keeps_the_plain_blocks_crc(piece):
    kv = _kv(37)
    block = encode_block("t", "m", kv)
    lay = SlotLayout.of(block.header, 5, 5 + 37 + 11)
    dest, src, crc = np.zeros(lay.nbytes, dtype=np.uint8), as_bytes_array(block.payload), 0
    from kvtransport.transfer.blocks import checksum_extend
    for off in range(0, src.nbytes, piece):                    # as a transport's chunks arrive
        for part in lay.put(dest, off, src[off:off + piece]):
            crc = checksum_extend(crc, part)
    assert crc == block.header.checksum == checksum(block.payload)
    roomy = KVBlock(block.header, memoryview(dest), layout=lay)
    verify(roomy)                                              # CRC over the rows, in payload order
    buf = block_buffer(roomy)
    assert buf.shape == (4, 2, 3, 53, 64) and torch.equal(buf[:, :, :, 5:42], kv.data)
    back = decode_block(roomy)
    assert torch.equal(back.data, kv.data) and back.data.data_ptr() == buf[:, :, :, 5:].data_ptr()
    dest[lay.lead * lay.slot_bytes + 3] ^= 0xFF                # a byte of the block, not of the room
    with pytest.raises(BlockError, match="checksum"):
        verify(KVBlock(block.header, memoryview(dest), layout=lay))
    with pytest.raises(BlockError, match="layout"):
        verify(KVBlock(block.header, memoryview(dest[:-64]), layout=lay))


@pytest.mark.parametrize("check", ["always", "auto"])
def test_grpc_receives_into_the_granted_room_and_accounts_its_bytes(check):
    cfg = GrpcTransportConfig(chunk_bytes=64 << 10, max_message_bytes=2 << 20, checksum=check, require_grant=True)
    rx, tx = GrpcTransport(cfg, model="m"), GrpcTransport(cfg)
    try:
        addr = rx.serve()
        kv = _kv(300)
        grant, cred = TransferGrant.issue("r-1", "m", "float32", kv.token_ids.tolist(), first_position=5)
        rx.expect(dataclasses.replace(grant, room=20))
        header, payload = block_header("r-1", "m", kv, credential=cred)
        assert tx.send_kv(addr, header, payload, timeout=10).bytes_sent == payload.nbytes   # the plain bytes
        assert rx.stats().held_bytes == 4 * 2 * 3 * (5 + 300 + 20) * 64 * 4                  # the buffer's
        block = rx.receive("r-1", timeout=1)
        assert block.layout == SlotLayout.of(block.header, 5, 325)
        got = decode_block(block, model="m")
        assert torch.equal(got.data, kv.data) and torch.equal(got.positions, kv.positions)
        assert got.data.data_ptr() == block_buffer(block)[:, :, :, 5:].data_ptr()
        assert rx.stats().held_bytes == 0
    finally:
        tx.stop()
        rx.stop()


def test_room_that_does_not_fit_is_dropped_counted_and_the_block_received_plain():
    kv = _kv(40)
    grant, _ = TransferGrant.issue("r-2", "m", "float32", kv.token_ids.tolist(), first_position=5)
    header = block_header("r-2", "m", kv)[0]
    inbox = Inbox(1 << 30, header.payload_bytes + 100, 60, require_grant=False)
    inbox.expect(dataclasses.replace(grant, room=1000))        # over max_block_bytes
    assert inbox.begin("r-2", header.payload_bytes, header) is None
    assert inbox.stats().roomless == 1 and inbox.stats().held_bytes == header.payload_bytes


# ---- the reference decode engine: the session runs in the buffer the block was received into ----

@pytest.fixture(scope="module")
def wired(smol, one_torch_thread):
    rx = Receiver("grpc", smol.spec.name, "float32", bind="127.0.0.1", advertise="127.0.0.1")
    tx = Sender("grpc")
    pre = PrefillExecutor(smol, DictSource(smol), tx)
    try:
        yield smol, rx, pre
    finally:
        tx.stop()
        rx.stop()


class _Recorded(DecodeSession):
    made: list = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        _Recorded.made.append((self, kw.get("buffer")))


def _run(e, rx, pre, dec, plan, room: int, salt="s", max_tokens=8):
    """What the router and DecodeWorker.expect do, then the decode: (held, events, session, buffer)."""
    tid = uuid.uuid4().hex
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", plan.prefix_ids)
    reply = announce(dec, rx, TransferExpectation(grant, plan.prefix_ids, salt, None, room))
    assert pre.execute(plan, rx.endpoint, tid, credential=cred, send_from=reply.held).transferred
    _Recorded.made.clear()
    events = list(dec.generate(tid, plan.prefix_ids, plan.suffix_ids,
                               SamplingParams(max_tokens=max_tokens, logprobs=3), salt=salt))
    (session, buf), = [m for m in _Recorded.made if m[0].length >= len(plan.prefix_ids)]
    return reply.held, events, session, buf


@pytest.mark.slow
def test_the_suffix_runs_in_the_buffer_the_block_was_received_into(wired, monkeypatch):
    e, rx, pre = wired
    monkeypatch.setattr(executor_mod, "DecodeSession", _Recorded)
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    plain = DecodeExecutor(e, rx, receive_timeout=10)
    _, old, s0, buf0 = _run(e, rx, pre, plain, plan, room=0)          # no room granted: copied, as before
    assert buf0 is None and s0.copied_bytes == plain.copied_bytes > 0

    dec = DecodeExecutor(e, rx, receive_timeout=10, held=HeldPrefixes(64 << 20))
    n, room = len(plan.prefix_ids), len(plan.suffix_ids) + 8
    held, new, s1, buf1 = _run(e, rx, pre, dec, plan, room=room)
    assert held == 0 and buf1 is not None
    # the storage the suffix and every decode step ran in is the one the block was received into
    assert s1.data is buf1 and s1.data.data_ptr() == buf1.data_ptr() and s1.capacity == n + room
    assert s1.copied_bytes == dec.copied_bytes == 0 and s1.length > n + len(plan.suffix_ids)
    assert [(ev.token_id, ev.logprob, ev.top_logprobs) for ev in new if isinstance(ev, TokenEvent)] == \
           [(ev.token_id, ev.logprob, ev.top_logprobs) for ev in old if isinstance(ev, TokenEvent)]   # bit-equal
    assert new[-1].fallbacks == () and new[-1].loaded_tokens == n

    # the next request holds all but one token: that one lands after the held slots, in the same buffer
    held, again, s2, buf2 = _run(e, rx, pre, dec, plan, room=room)
    assert held == n - 1 and s2.data is buf2 and s2.capacity == n + room and dec.copied_bytes == 0
    assert again[-1].fallbacks == () and again[-1].loaded_tokens == 1
    assert [ev.token_id for ev in again if isinstance(ev, TokenEvent)] == \
           [ev.token_id for ev in old if isinstance(ev, TokenEvent)]


def test_only_an_engine_that_decodes_in_the_receive_buffer_is_granted_room():
    """``announce`` (DecodeWorker.expect) puts the router's room on the grant for the reference
    engine (``receive_room``) only; vLLM writes the block into its paged cache, so it gets none."""
    class Engine:
        held = None

        def __init__(self, receive_room):
            self.receive_room = receive_room

        def hold(self, grant, prefix_ids, salt, computes_from=None):
            return 0

    class Receiver:
        def expect(self, grant):
            self.grant = grant

    grant, _ = TransferGrant.issue("a-1", "m", "float32", (1, 2, 3))
    for receive_room, room, want in ((True, 9, 9), (False, 9, None), (True, 0, None)):
        rx = Receiver()
        announce(Engine(receive_room), rx, TransferExpectation(grant, (1, 2, 3), "s", None, room))
        assert rx.grant.room == want, (receive_room, room)
