"""Router + real executors + real gRPC, in one process (no Ray): a KV block whose checksum is
wrong is rejected by the decode side, the request still completes by recompute, and the
fallback is counted in kvnotes_fallbacks_total."""
import asyncio
import dataclasses

import pytest

from cluster.metrics import Metrics
from cluster.render import Registry, Renderer
from cluster.router import Finished, Router
from decode_workers.executor import DecodeExecutor
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvtransport.grpc_transport import GrpcTransport
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource

pytestmark = pytest.mark.slow


class CorruptingTransport(GrpcTransport):
    """The real gRPC sender, flipping the header checksum of every block it sends."""

    def send(self, address, block, *, timeout):
        bad = dataclasses.replace(block.header, checksum=block.header.checksum ^ 0x5A5A)
        return super().send(address, dataclasses.replace(block, header=bad), timeout=timeout)




class LocalBackends:
    """Backends in one process (the router's seam); the shipped one is cluster.ray_backends."""

    def __init__(self, engine, sender):
        self.num_prefill = self.num_decode = 1
        self.rx = GrpcTransport(model=engine.spec.name)
        self.addr = self.rx.serve()
        self.source = DictSource()
        self.pre = PrefillExecutor(engine, self.source, sender)
        self.dec = DecodeExecutor(engine, self.rx, receive_timeout=5)

    async def contains(self, keys, index=0):
        return {k for k in keys if k in self.source.d}

    async def precompile(self, key, token_ids, tenant):
        from kvruntime.ops import precompile_chunk
        self.source.d[key] = precompile_chunk(self.pre.engine, list(token_ids))
        return {"cached": False, "bytes": 0, "seconds": 0.0}

    async def evict(self, key):
        return self.source.d.pop(key, None) is not None

    async def prefill(self, index, plan, decode_index, transfer_id, store_as):
        return self.pre.execute(plan, self.addr, transfer_id, store_context_as=store_as)

    async def decode(self, index, transfer_id, prefix, suffix, sampling, salt):
        for ev in self.dec.generate(transfer_id, prefix, suffix, sampling):
            yield ev


def _router(engine, sender):
    b = LocalBackends(engine, sender)
    return Router(b, Renderer(engine.tokenizer, engine.spec, Registry(), engine.bos_id), "m", "float32",
                  metrics=Metrics()), b


async def _complete(router, segments, policy):
    toks, fin = [], None
    async for ev in router.stream_native("default", segments, policy=policy, session=None,
                                         sampling=SamplingParams(max_tokens=10, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def test_wrong_checksum_is_rejected_and_request_completes_by_recompute(smol):
    good, gb = _router(smol, GrpcTransport())
    bad, bb = _router(smol, CorruptingTransport())
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


def test_registered_chunk_missing_from_tier_is_counted(smol):
    router, b = _router(smol, GrpcTransport())
    try:
        info = asyncio.run(router.register_chunk("skill", "default", "museum", "The Varga Museum closes at 17:30."))
        assert info["tokens"] > 5
        b.source.d.clear()                                      # the tier lost it after registration
        toks, fin = asyncio.run(_complete(router, [{"skill": "museum"}, {"text": "When does it close?"}], "fast"))
        assert fin.plan.kind.value == "recompute" and len(toks) > 0            # planner saw the miss: no fallback
        assert any("not precompiled" in n for n in fin.plan.notes)
    finally:
        b.rx.stop()
