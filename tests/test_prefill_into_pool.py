"""The prefill assembles the KV it ships over NIXL in the sender's registered pool
(``Sender.alloc``): the real executor on SmolLM2, a real Sender and Receiver (NIXL + gRPC) in
this process. The block goes out without a staging copy, arrives byte-identical with its CRC
checked, and the lease ends with the request; a pool too small to build in is a counted
fallback (``kv_send_pool_full``) whose block still arrives, copied by the send."""
import dataclasses
import gc
import uuid

import pytest
import torch

from cluster.control.planner import RenderedRequest, RenderedSegment, TierView, plan_request
from kvruntime.messages.plan import KVRef, PlanKind, Policy
from kvruntime.messages.transfer import TransferGrant
from kvruntime.ops import precompile_chunk
from kvtransport.transfer.blocks import decode_block
from kvtransport.transfer.endpoints import Receiver, Sender
from kvtransport.transfer.nixl_transport import NixlTransportConfig
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource

SALT = "5b" * 16
TEXTS = ("The Varga Museum opens at 10:00 and closes at 17:30; entry costs 12 euros.\n\n",
         "The Oduya Library lends up to six books for three weeks; renewals are free online.\n\n")


def _plan(e, src):
    """A FAST plan: frame recomputed, two skills loaded from the tier and repositioned, seams repaired
    (the frame's ids as plain text: a chunk right after the frame would be exact reuse instead)."""
    frame = RenderedSegment("text", None, tuple(e.encode(e.spec.chat_user_prefix)))
    skills = []
    for i, text in enumerate(TEXTS):
        ids = tuple(e.encode(text))
        skills.append(RenderedSegment("skill", f"s{i}", ids, kv=KVRef(ids, 1, SALT)))
        src.put(skills[-1].kv, precompile_chunk(e, list(ids)))
    q = tuple(e.encode("When does the Varga Museum close?" + e.spec.chat_user_suffix))
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.FAST, (frame, *skills), q),
                        TierView(frozenset(s.kv.digest for s in skills)), None, e.encode)
    assert [s.kind for s in plan.steps][-2:] == [PlanKind.REPOSITION, PlanKind.REPOSITION]
    return plan


@pytest.fixture(scope="module")
def receiver(smol):
    rx = Receiver("nixl", smol.spec.name, "float32", bind="127.0.0.1")
    yield rx
    rx.stop()


def _ship(pre, rx, plan):
    tid = uuid.uuid4().hex
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", plan.prefix_ids)
    rx.expect(grant)
    res = pre.execute(plan, rx.endpoint, tid, credential=cred)
    return res, rx.receive(tid, timeout=10)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.slow
def test_kv_built_in_the_pool_is_sent_without_a_staging_copy(smol, receiver):
    src, tx = DictSource(smol), Sender("nixl")
    try:
        pre = PrefillExecutor(smol, src, tx)
        plan = _plan(smol, src)
        assert tx.builds_into_pool(receiver.endpoint, smol.dtype)
        res, block = _ship(pre, receiver, plan)
        assert res.transferred and res.transport == "nixl" and res.stats.fallbacks == []
        assert tx.nixl.counters["staged_bytes"] == 0 and tx.nixl.counters["zero_copy_sends"] == 1
        assert block.verified_payload is block.payload                  # the receiver checked the CRC
        want, _ = pre.build(plan)                                       # the same plan, ordinary memory
        assert _same_bytes(decode_block(block, model=smol.spec.name).data, want.data)
        gc.collect()
        assert tx.nixl.pool.leased_bytes == 0                           # the KV's lease ended with the request
    finally:
        tx.stop()


@pytest.mark.slow
def test_a_pool_too_small_to_build_in_is_a_counted_fallback_and_the_send_copies(smol, receiver):
    src = DictSource(smol)
    plan = _plan(smol, src)
    n = plan.prefix_tokens * smol.num_layers * 2 * smol.kv_heads * smol.head_dim * 4
    # room for the whole block, but another request's block still holds a page while this prefix is
    # built (its one buffer, allocated at the final size, does not fit) and is released before the send
    tx = Sender("nixl", NixlTransportConfig(pool_bytes=-(-n // 4096) * 4096))
    held, asked, pool_alloc = [tx.nixl.lease(4096)], [], tx.alloc

    def alloc(shape, dtype):
        asked.append(pool_alloc(shape, dtype))
        held.clear()
        return asked[-1]
    tx.alloc = alloc
    try:
        res, block = _ship(PrefillExecutor(smol, src, tx), receiver, plan)
        assert len(asked) == 1 and asked[0] is None                      # the build asked once, found no room
        assert res.transferred and res.transport == "nixl" and res.stats.fallbacks == ["kv_send_pool_full"]
        assert tx.nixl.counters["staged_bytes"] == n and tx.nixl.counters["zero_copy_sends"] == 0
        want, _ = PrefillExecutor(smol, src, tx).build(plan)
        assert _same_bytes(decode_block(block, model=smol.spec.name).data, want.data)
    finally:
        tx.stop()


@pytest.mark.slow
def test_build_into_pool_off_or_another_wire_dtype_ships_through_a_staging_copy(smol, receiver):
    """``build_into_pool: false`` (kv_nixl), or a decode engine in another dtype: the prefix is
    built in ordinary memory and the send copies it (casting in the same pass); no fallback."""
    src = DictSource(smol)
    plan = _plan(smol, src)
    n = plan.prefix_tokens * smol.num_layers * 2 * smol.kv_heads * smol.head_dim * 4
    tx = Sender("nixl", NixlTransportConfig(build_into_pool=False))
    try:
        assert not tx.builds_into_pool(receiver.endpoint, smol.dtype)
        res, block = _ship(PrefillExecutor(smol, src, tx), receiver, plan)
        assert res.transferred and res.stats.fallbacks == [] and tx.nixl.counters["staged_bytes"] == n
        want, _ = PrefillExecutor(smol, src, tx).build(plan)
        assert _same_bytes(decode_block(block, model=smol.spec.name).data, want.data)
    finally:
        tx.stop()
    tx = Sender("nixl")
    assert not tx.builds_into_pool(dataclasses.replace(receiver.endpoint, dtype="bfloat16"), smol.dtype)
    tx.stop()
