"""Router + real executors + real gRPC, in one process (no Ray): a KV block whose checksum is
wrong is rejected by the decode side, the request still completes by recompute, and the
fallback is counted in kvnotes_fallbacks_total."""
import asyncio
import dataclasses

import pytest

from cluster.control.backends import Backends
from cluster.control.metrics import Metrics
from cluster.control.registry import Registry
from cluster.control.render import Renderer
from cluster.control.state import open_state
from cluster.control.lifecycle import Finished
from cluster.control.context import RequestContext
from cluster.control.router import Router
from kvruntime.messages.transfer import ExpectReply
from cluster.control.router_sections import ModelSection
from decode_workers.executor import DecodeExecutor
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvtransport.transfer.endpoints import BlockKVSender
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource

pytestmark = pytest.mark.slow


class CorruptingTransport(GrpcTransport):
    """The real gRPC sender, flipping the header checksum of every block it sends."""

    def send(self, address, block, *, timeout):
        bad = dataclasses.replace(block.header, checksum=block.header.checksum ^ 0x5A5A)
        return super().send(address, dataclasses.replace(block, header=bad), timeout=timeout)




# text before the skill: the skill is not first after the frame, so "fast" repositions it (the
# first chunk after the frame is exact reuse, test_the_default_policy_reuses_...)
LATE_SKILL = [{"text": "Visitor desk notes follow."}, {"skill": "museum"}, {"text": "When does it close?"}]


class LocalBackends(Backends):
    """Backends in one process (the router's seam); the shipped one is cluster.control.ray_backends."""

    def __init__(self, engine, sender):
        self.num_prefill = self.num_decode = 1
        self.rx = GrpcTransport(GrpcTransportConfig(require_grant=True), model=engine.spec.name)
        self.addr = self.rx.serve()
        self.source = DictSource(engine)
        self.pre = PrefillExecutor(engine, self.source, sender)
        self.dec = DecodeExecutor(engine, self.rx, receive_timeout=5)

    async def contains(self, refs, index=0):
        return [self.source.get(r) is not None for r in refs]

    async def precompile(self, ref, index=0):
        from kvruntime.messages.prefill import PrecompileInfo
        if self.source.get(ref) is not None:
            return PrecompileInfo(True, 0, 0.0, "local")
        kv = self.source.compile(ref)
        return PrecompileInfo(False, kv.nbytes, 0.0, "local")

    async def evict(self, ref):
        return self.source.d.pop(self.source._k(ref), None) is not None

    async def expect(self, decode_index, expectation):
        self.rx.expect(expectation.grant)
        return ExpectReply(0, False)               # the reference engine keeps no KV across requests

    async def prefill(self, index, decode_index, job):
        return self.pre.execute(job.plan, self.addr, job.transfer_id, store_as=job.store_as,
                                credential=job.credential, send_from=job.send_from)

    async def decode(self, index, job):
        for ev in self.dec.generate(job.transfer_id, job.prefix_ids, job.suffix_ids, job.sampling,
                                    continuation=job.continuation):
            yield ev


def make_router(engine, backends, state):
    return Router(backends, Renderer(engine.tokenizer, engine.spec, Registry(state), engine.bos_id), state,
                  ModelSection("m", "float32"), metrics=Metrics())


def _router(engine, sender, tmp_path):
    b = LocalBackends(engine, sender)
    return make_router(engine, b, open_state(f"sqlite:///{tmp_path}/state-{id(b)}.db")), b


async def _complete(router, segments, policy, clock=None):
    toks, fin = [], None
    async for ev in router.stream_native(RequestContext.local(policy=policy, clock=clock), segments, session=None,
                                         sampling=SamplingParams(max_tokens=10, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def test_wrong_checksum_is_rejected_and_request_completes_by_recompute(smol, tmp_path):
    good, gb = _router(smol, BlockKVSender(GrpcTransport()), tmp_path)
    bad, bb = _router(smol, BlockKVSender(CorruptingTransport()), tmp_path)
    try:
        segs = [{"text": "The lighthouse on Hallo Point was built in 1871. When was it built?"}]
        want, fin_ok = asyncio.run(_complete(good, segs, "exact"))
        got, fin = asyncio.run(_complete(bad, segs, "exact"))
        assert got == want and len(got) > 0                                   # same answer, by recompute
        assert fin_ok.fallbacks == () and fin.fallbacks == ("kv_transfer_rejected",)
        assert isinstance(fin, Finished) and fin.cached_tokens == 0
        text = bad.metrics.render().decode()
        assert 'kvnotes_fallbacks_total{reason="kv_transfer_rejected"} 1.0' in text
        assert 'kvnotes_kv_transfer_bytes_total{transport="grpc"}' not in text  # nothing counted as delivered
    finally:
        gb.rx.stop()
        bb.rx.stop()


def test_a_fallback_is_labelled_with_what_executed(smol, tmp_path):
    """A planned reposition whose block is refused executes as a recompute: TTFT and the request
    are labelled recompute, with the fallback reason (an operator must not see a fast reposition)."""
    from tests.conftest import metric
    router, b = _router(smol, BlockKVSender(CorruptingTransport()), tmp_path)
    try:
        asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        toks, fin = asyncio.run(_complete(router, LATE_SKILL, "fast"))
        assert len(toks) > 0 and fin.plan.kind.value == "reposition" and fin.fallbacks == ("kv_transfer_rejected",)
        text = router.metrics.render().decode()
        assert metric(text, "kvnotes_ttft_seconds_count", plan="recompute") == 1
        assert metric(text, "kvnotes_ttft_seconds_count", plan="reposition") == 0
        assert metric(text, "kvnotes_requests_total", plan="recompute", status="ok",
                      fallback="kv_transfer_rejected") == 1
    finally:
        b.rx.stop()


class NixlToGrpcBackends(LocalBackends):
    """The cluster's own Sender (NIXL and gRPC) pushing to a decode inbox that runs gRPC only."""

    async def prefill(self, index, decode_index, job):
        from kvruntime.messages.transfer import KVEndpoint
        ep = KVEndpoint("grpc", self.addr, "float32", "", "", b"")
        return self.pre.execute(job.plan, ep, job.transfer_id, store_as=job.store_as, credential=job.credential,
                                send_from=job.send_from)


def test_a_block_that_travelled_over_grpc_instead_of_nixl_is_still_what_was_planned(smol, tmp_path):
    """kv_transport_nixl_unavailable is counted, but the block arrived: the request is labelled
    with its planned kind (reposition), not recompute."""
    from kvtransport.transfer.endpoints import Sender
    from tests.conftest import metric
    sender = Sender("auto")
    b = NixlToGrpcBackends(smol, sender)
    router = make_router(smol, b, open_state(f"sqlite:///{tmp_path}/state-nixl.db"))
    try:
        asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        toks, fin = asyncio.run(_complete(router, LATE_SKILL, "fast"))
        assert len(toks) > 0 and fin.plan.kind.value == "reposition"
        assert fin.fallbacks == ("kv_transport_nixl_unavailable",) and fin.cached_tokens > 0
        text = router.metrics.render().decode()
        assert metric(text, "kvnotes_ttft_seconds_count", plan="reposition") == 1
        assert metric(text, "kvnotes_ttft_seconds_count", plan="recompute") == 0
        assert metric(text, "kvnotes_requests_total", plan="reposition", status="ok",
                      fallback="kv_transport_nixl_unavailable") == 1
        assert metric(text, "kvnotes_fallbacks_total", reason="kv_transport_nixl_unavailable") == 1
    finally:
        sender.stop()
        b.rx.stop()


def test_an_evicted_chunk_is_listed_out_of_tier_counted_as_a_miss_and_rewarmed(smol, tmp_path):
    router, b = _router(smol, BlockKVSender(GrpcTransport()), tmp_path)
    try:
        info = asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        assert info["tokens"] > 5 and not info["cached"]
        assert [x["in_tier"] for x in asyncio.run(router.listing("skill", "default"))] == [True]
        b.source.d.clear()                                      # the tier lost it after registration
        assert [x["in_tier"] for x in asyncio.run(router.listing("skill", "default"))] == [False]
        m0 = router.metrics.render().decode()
        toks, fin = asyncio.run(_complete(router, LATE_SKILL, "fast"))
        assert len(toks) > 0 and fin.fallbacks == ()
        assert fin.plan.steps[-1].kind.value == "reposition" and "re-warmed" in fin.plan.steps[-1].reason
        # registration compiled the chunk and its frame variant; the re-warm compiles it once more
        assert any("not in the tier: re-warmed" in n for n in fin.plan.notes) and b.source.compiled == 3
        text = router.metrics.render().decode()
        assert "kvnotes_tier_rewarms_total 1.0" in text
        assert _metric(text, 'kvnotes_tier_lookups_total{tier="lmcache"}') - \
            _metric(m0, 'kvnotes_tier_lookups_total{tier="lmcache"}') == 1
        assert _metric(text, 'kvnotes_tier_hits_total{tier="lmcache"}') == _metric(m0, 'kvnotes_tier_hits_total{tier="lmcache"}')
        toks2, fin2 = asyncio.run(_complete(router, LATE_SKILL, "fast"))
        assert toks2 == toks and "re-warmed" not in fin2.plan.steps[-1].reason     # the next use hits
        assert b.source.compiled == 3 and [x["in_tier"] for x in asyncio.run(router.listing("skill", "default"))] == [True]
    finally:
        b.rx.stop()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_the_default_policy_reuses_a_skill_after_the_frame_exactly_one_variant_per_frame(smol, tmp_path):
    """The README's demo with the default policy (balanced; SmolLM2's profile meets no compose
    target): the skill comes first after the chat frame, so frame + skill are one exact reuse of
    their variant compiled together, precompiled at registration (counted): the first request
    computes no prefix token; a variant the tier lost is compiled on first use (counted) and a
    tier hit after; the answer is the recompute's, token for token."""
    from kvruntime.ops import recompute
    router, b = _router(smol, BlockKVSender(GrpcTransport()), tmp_path)
    try:
        info = asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        assert info["frame_variant"]["cached"] is False
        assert _metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total") == 1
        segs = [{"skill": "museum"}, {"text": "When does it close?"}]
        toks, fin = asyncio.run(_complete(router, segs, None))
        (step,) = fin.plan.steps
        assert fin.plan.policy.value == "balanced" and fin.fallbacks == ()
        assert step.kind.value == "reuse" and "compiled together: exact, reused" in step.reason and fin.plan.approx == ""
        assert step.kv.prefix == () and step.position == 0 and step.token_ids[:len(router.renderer.frame())] == \
            router.renderer.frame()
        assert step.reused == step.tokens and info["frame_variant"]["key"] == step.kv.digest
        full = recompute(smol, list(fin.plan.prefix_ids + fin.plan.suffix_ids))
        assert toks == [t for t in smol.greedy(full.kv, full.logits, 10, stop_at_eos=True) if t not in smol.eos_ids]
        b.source.d.pop(b.source._k(step.kv))                                       # the tier lost the variant
        toks2, fin2 = asyncio.run(_complete(router, segs, None))
        assert toks2 == toks and fin2.plan.steps[0].computed == step.tokens and "first use" in fin2.plan.steps[0].reason
        assert _metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total") == 2
        toks3, fin3 = asyncio.run(_complete(router, segs, None))                   # in the tier again
        assert toks3 == toks and fin3.plan.steps[0].reused == step.tokens
        assert _metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total") == 2
        exact, fin4 = asyncio.run(_complete(router, segs, "exact"))                # same variant, same answer
        assert exact == toks and fin4.plan.steps[0].kv == step.kv
    finally:
        b.rx.stop()
