"""Nothing is computed that a tier or the decode engine already holds.

In process (router + real executors + real gRPC, no Ray): the prompt lookup falls back to the
longest indexed prefix the tier still holds (one batched lookup), a decode engine holding the
prefix computes the rest itself (no prefill runs, the chat frame is not computed again), and
``usage.cached_tokens`` equals the prompt tokens by source nobody computed. One test goes
through a real cluster."""
import asyncio
import time
from collections import Counter

import pytest
import torch

from cluster.control.context import RequestContext
from cluster.control.backends import Backends
from cluster.control.lifecycle import Finished
from cluster.control.metrics import CACHED_SOURCES, prompt_sources
from cluster.control.prompt_index import PROMPT_BLOCK, prompt_hash
from cluster.control.state import open_state
from decode_workers.actor import announce
from decode_workers.executor import DecodeExecutor
from decode_workers.held_kv import HeldPrefixes
from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from kvruntime.messages.prefill import PrefillResult, PrefillStats
from kvtransport.transfer.endpoints import BlockKVSender
from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource, metric
from tests.test_router_fallback import make_router

pytestmark = pytest.mark.slow

WORDS = " ".join(f"Clause {i}: the tenant keeps unit {i * 13 % 97} tidy." for i in range(60))


class PieceSource(DictSource):
    """Like the LMCache tier: a stored prefix serves every prefix of it ending on a piece
    boundary (``PROMPT_BLOCK``), until evicted."""

    def get(self, ref):
        got = super().get(ref)
        if got is not None or ref.position != 0 or len(ref.token_ids) % PROMPT_BLOCK:
            return got
        n = len(ref.token_ids)
        for (ids, pos, salt, approx, prefix), kv in self.d.items():
            if (pos, salt, approx, prefix) == (0, ref.tenant_salt, ref.approx, ref.prefix) and ids[:n] == ref.token_ids:
                return kv.slice(0, n)
        return None

    def keep_only(self, n: int) -> None:
        """The tier's LRU took every piece past the first ``n`` tokens of each stored prefix."""
        for (ids, pos, salt, approx, prefix), kv in list(self.d.items()):
            del self.d[(ids, pos, salt, approx, prefix)]
            if len(ids) > n:
                self.d[(ids[:n], pos, salt, approx, prefix)] = kv.slice(0, n)


class ReuseBackends(Backends):
    """In-process backends whose decode side is the reference decode actor's: a held prefix
    cache, ``announce`` (``DecodeWorker.expect``) and ``generate`` with ``held_only``."""

    def __init__(self, engine):
        self.num_prefill = self.num_decode = 1
        self.rx = GrpcTransport(GrpcTransportConfig(require_grant=True), model=engine.spec.name)
        self.addr = self.rx.serve()
        self.source = PieceSource(engine)
        self.pre = PrefillExecutor(engine, self.source, BlockKVSender(GrpcTransport()))
        self.dec = DecodeExecutor(engine, self.rx, receive_timeout=10, held=HeldPrefixes(256 << 20))
        self.calls: Counter = Counter()

    async def contains(self, refs, index=0):
        self.calls["contains"] += 1
        return [self.source.get(r) is not None for r in refs]

    async def precompile(self, ref, index=0, base=None):
        from kvruntime.messages.prefill import PrecompileInfo
        held = self.source.get(base) if base is not None else None
        if held is not None:            # store-behind's delta, as PrefillTier does (prefill_workers.store_delta)
            from prefill_workers.store_delta import continued
            kv = continued(self.source.engine, ref, base, held)
            self.source.put(ref, kv)
        else:
            kv = self.source.compile(ref)
        return PrecompileInfo(False, kv.nbytes, 0.0, "local", len(base.token_ids) if held is not None else 0)

    async def evict(self, ref):
        return self.source.d.pop(self.source._k(ref), None) is not None

    async def expect(self, decode_index, expectation):
        return announce(self.dec, self.rx, expectation)

    async def prefill(self, index, decode_index, job):
        self.calls["prefill"] += 1
        return self.pre.execute(job.plan, self.addr, job.transfer_id, store_as=job.store_as,
                                credential=job.credential, send_from=job.send_from)

    async def decode(self, index, job):
        for ev in self.dec.generate(job.transfer_id, job.prefix_ids, job.suffix_ids, job.sampling,
                                    salt=job.kv_salt, held_only=job.computes_rest):
            yield ev


@pytest.fixture
def rig(smol, tmp_path):
    b = ReuseBackends(smol)
    router = make_router(smol, b, open_state(f"sqlite:///{tmp_path}/state.db"))
    yield router, b
    b.rx.stop()


async def _prompt(router, ids, max_tokens=4):
    toks, fin = [], None
    async for ev in router.stream_prompt(RequestContext.local("default", policy="exact"), list(ids),
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


async def _native(router, segments, policy, max_tokens=4):
    toks, fin = [], None
    async for ev in router.stream_native(RequestContext.local("default", policy=policy), segments, session=None,
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def _check_sources(fin: Finished) -> dict:
    """cached_tokens is exactly the tokens nobody computed, by source; sources sum to the prompt."""
    src = dict(fin.sources)
    assert sum(src.values()) == fin.prompt_tokens and min(src.values()) >= 0, src
    assert fin.cached_tokens == sum(src[k] for k in CACHED_SOURCES), (fin.cached_tokens, src)
    return src


def _ids(smol, n):
    ids = smol.encode(WORDS)
    assert len(ids) >= n
    return tuple(ids[:n])


def test_lookup_skips_a_missing_longer_prefix_in_one_batched_lookup(smol, rig):
    router, b = rig
    salt = router.salt("default")
    prefix = _ids(smol, 3 * PROMPT_BLOCK + 40)
    bounds = [PROMPT_BLOCK, 2 * PROMPT_BLOCK, 3 * PROMPT_BLOCK, len(prefix)]
    router.state.put_prompt_blocks("default", {prompt_hash("default", prefix[:n]): n for n in bounds}, time.time())
    ref = KVRef(prefix[:2 * PROMPT_BLOCK], 0, salt)                 # only the 512-token prefix is left
    b.source.put(ref, smol.prefill(list(ref.token_ids), torch.arange(len(ref.token_ids))).kv)
    got, hit = asyncio.run(router.prompt_index.longest_held("default", salt, prefix, 0))
    assert (got, hit) == (ref, 2 * PROMPT_BLOCK)
    assert b.calls["contains"] == 1                                  # every candidate in one lookup
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_fallbacks_total", reason="prompt_prefix_evicted") == 1
    assert metric(text, "kvnotes_tier_lookups_total", tier="lmcache") == 4
    assert metric(text, "kvnotes_tier_hits_total", tier="lmcache") == 2          # 512 and 256 present
    b.source.d.clear()
    assert asyncio.run(router.prompt_index.longest_held("default", salt, prefix, 0)) == (None, 0)


def test_after_eviction_a_repeat_reuses_the_shorter_prefix(smol, rig):
    router, b = rig
    ids = _ids(smol, 2 * PROMPT_BLOCK + 60)
    want, first = asyncio.run(_prompt(router, ids))
    assert first.stored and _check_sources(first)["computed"] == first.prompt_tokens
    b.source.keep_only(2 * PROMPT_BLOCK)          # the tier lost the pieces past 512 tokens
    b.dec.held = HeldPrefixes(256 << 20)          # and the decode engine holds nothing
    got, again = asyncio.run(_prompt(router, ids))
    assert got == want
    assert [s.kind for s in again.plan.steps] == [PlanKind.REUSE, PlanKind.RECOMPUTE]
    assert again.plan.steps[0].tokens == 2 * PROMPT_BLOCK
    src = _check_sources(again)
    assert src["reused"] == 2 * PROMPT_BLOCK and src["decode_cache"] == 0
    assert again.cached_tokens == 2 * PROMPT_BLOCK


def test_a_held_prefix_is_neither_built_nor_sent_and_cached_tokens_match_the_sources(smol, rig):
    router, b = rig
    ids = _ids(smol, PROMPT_BLOCK + 100)
    want, first = asyncio.run(_prompt(router, ids))
    pre0 = b.calls["prefill"]
    m0 = router.metrics.render().decode()
    got, again = asyncio.run(_prompt(router, ids))
    assert got == want
    assert b.calls["prefill"] == pre0                                 # no prefill ran
    src = _check_sources(again)
    n = len(ids) - 1                                                  # the prompt's prefix
    # the decode engine holds the whole prefix: it computed only the suffix, nothing was loaded
    assert src["decode_cache"] == n and src["computed"] == 1 and src["reused"] == 0
    m1 = router.metrics.render().decode()
    for k, v in src.items():                                          # the metrics say the same
        assert metric(m1, "kvnotes_prompt_tokens_total", source=k) - \
            metric(m0, "kvnotes_prompt_tokens_total", source=k) == v, k
    assert metric(m1, "kvnotes_kv_transfer_bytes_total") == metric(m0, "kvnotes_kv_transfer_bytes_total")


def test_tokens_the_prefill_worker_built_are_not_counted_as_cached():
    """The misreport: a decode engine holding the prefix the prefill worker computed anyway."""
    steps = (SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=tuple(range(100)), position=0,
                         computed=100, reused=0),)
    plan = RequestPlan("r", "m", Policy.EXACT, steps, (7,))
    res = PrefillResult("r", "t", 100, 0.1, 10, 0.0, PrefillStats(computed=100, not_sent=95), True)
    summary = DecodeSummary(1, "length", (), 0.0, "", cached_tokens=100, loaded_tokens=5)
    assert prompt_sources(plan, res, summary) == {"reused": 0, "repositioned": 0, "decode_cache": 0,
                                                  "erratum": 0, "computed": 101}
    lost = DecodeSummary(1, "length", ("kv_mismatch",), 0.0, "", cached_tokens=64, loaded_tokens=0)
    reuse = (SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=tuple(range(80)), position=0, computed=0,
                         reused=80),
             SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=tuple(range(80, 100)), position=80,
                         computed=20, reused=0))
    plan2 = RequestPlan("r", "m", Policy.EXACT, reuse, (7,))
    res2 = PrefillResult("r", "t", 100, 0.1, 10, 0.0, PrefillStats(computed=20, reused=80), True)
    assert prompt_sources(plan2, res2, lost)["decode_cache"] == 44     # its hit less what was computed
    assert prompt_sources(plan2, None, summary) == {"reused": 0, "repositioned": 0, "decode_cache": 100,
                                                    "erratum": 0, "computed": 1}


def test_a_repeat_request_computes_no_frame_token(smol, rig):
    """The chat frame (system prompt + user-turn opener) is rendered again every request; on a
    repeat its KV comes from the decode engine's held prefix, never a forward pass."""
    router, b = rig
    asyncio.run(router.register_chunk("skill", "default", "lease", WORDS[:600]))
    frame = router.renderer.frame()
    assert len(frame) > 5
    for policy in ("exact", "fast"):
        segs = [{"skill": "lease"}, {"text": "Who keeps unit 13 tidy?"}]
        toks, first = asyncio.run(_native(router, segs, policy))
        assert first.plan.steps[0].source == "frame+skill:lease" and first.plan.steps[0].kind is PlanKind.REUSE
        assert first.plan.steps[0].token_ids[:len(frame)] == frame and first.plan.steps[0].computed == 0
        pre0 = b.calls["prefill"]
        toks2, again = asyncio.run(_native(router, [{"skill": "lease"}, {"text": "And unit 26?"}], policy))
        assert again.plan.prefix_ids == first.plan.prefix_ids and b.calls["prefill"] == pre0
        src = _check_sources(again)
        # the decode engine computed only tokens after what it held, and it held past the frame
        assert src["decode_cache"] >= len(again.plan.prefix_ids) - 1 >= len(frame), (policy, src)
        assert src["computed"] == again.prompt_tokens - src["decode_cache"]


def test_another_chunk_order_after_the_same_frame_computes_no_frame_token(smol, rig):
    """Registration precompiles each chunk after the default chat frame (counted); a composed
    request, then another order of the same chunks after the same frame: the prefill worker loads
    frame + first chunk from the tier in one exact step and computes no frame token (its stage
    records), that KV is bit-for-bit a recompute of frame + chunk, and cached_tokens counts the
    frame's tokens as reused."""
    from kvruntime.ops import recompute
    router, b = rig
    built, results = [], []
    build, execute = b.pre.build, b.pre.execute
    b.pre.build = lambda *a, **kw: built.append(build(*a, **kw)) or built[-1]
    b.pre.execute = lambda *a, **kw: results.append(execute(*a, **kw)) or results[-1]
    m0 = metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total")
    words = WORDS.split(". ")
    regs = [asyncio.run(router.register_chunk("skill", "default", name, ". ".join(words[k::2]) + "."))
            for k, name in enumerate(("alpha", "beta"))]
    assert all(r["frame_variant"]["cached"] is False for r in regs)
    assert metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total") == m0 + 2
    frame = router.renderer.frame()
    asyncio.run(_native(router, [{"skill": "alpha"}, {"skill": "beta"}, {"text": "Who keeps unit 13 tidy?"}],
                        "exact"))
    for order, q in ((("beta", "alpha"), "And unit 26?"), (("beta",), "And unit 39?")):
        b.dec.held = HeldPrefixes(256 << 20)             # the decode engine holds no frame: the tier serves it
        toks, fin = asyncio.run(_native(router, [{"skill": n} for n in order] + [{"text": q}], "exact"))
        head = fin.plan.steps[0]
        assert head.kind is PlanKind.REUSE and head.source == "frame+skill:beta" and head.computed == 0
        assert "no frame forward pass" in head.reason and fin.plan.approx == ""
        st = results[-1].stats
        assert st.variants_compiled == 0 and st.fallbacks == [] and st.reused == head.tokens
        assert st.computed == fin.plan.prefix_tokens - head.tokens           # the later chunk only: no frame token
        kv, _ = built[-1]
        n = head.tokens
        assert torch.equal(kv.data[:, :, :, :n], recompute(smol, list(head.token_ids), logits=False).kv.data)
        assert kv.token_ids[:len(frame)].tolist() == list(frame)
        src = _check_sources(fin)
        assert src["reused"] == n and src["computed"] == fin.prompt_tokens - n - src["decode_cache"]
    assert metric(router.metrics.render().decode(), "kvnotes_chunk_variants_compiled_total") == m0 + 2


def test_concurrent_requests_sharing_a_long_prefix_reuse_it(smol, rig):
    router, b = rig
    common = _ids(smol, 2 * PROMPT_BLOCK + 30)
    asyncio.run(_prompt(router, common + (13,)))                      # sent once before
    tails = [tuple(smol.encode(f" Question {i}: who keeps unit {i}?")) for i in range(8)]

    async def burst():
        return await asyncio.gather(*(_prompt(router, common + t, max_tokens=2) for t in tails))

    out = asyncio.run(asyncio.wait_for(burst(), timeout=540))          # bounded: a hang fails, not blocks
    for toks, fin in out:
        src = _check_sources(fin)
        assert fin.cached_tokens >= 2 * PROMPT_BLOCK, src              # none recomputed in full
        assert src["computed"] <= fin.prompt_tokens - 2 * PROMPT_BLOCK
    b.dec.held = HeldPrefixes(256 << 20)                               # the tier alone still serves them
    out = asyncio.run(asyncio.wait_for(burst(), timeout=540))
    assert all(f.cached_tokens >= 2 * PROMPT_BLOCK for _, f in out)
    assert any(dict(f.sources)["reused"] >= 2 * PROMPT_BLOCK for _, f in out)


def test_a_repeated_native_request_reuses_its_context_whole_and_prefers_the_exact_one(smol, rig):
    """Two skills after the frame, outside a session: the first ``fast`` request composes the
    second skill (approximate KV, stored under its recipe); the same request again reuses that
    context whole. Once an ``exact`` request computed the context (stored exact, in the prompt
    index), every policy reuses that exact prefix (its very bytes) instead of composing."""
    router, b = rig
    words = WORDS.split(". ")
    for k, name in enumerate(("north", "south")):
        asyncio.run(router.register_chunk("skill", "default", name, ". ".join(words[k::2]) + "."))
    segs = [{"skill": "north"}, {"skill": "south"}]

    def ask(policy, q):
        b.dec.held = HeldPrefixes(256 << 20)          # the tier, not the decode engine, serves repeats
        return asyncio.run(_native(router, segs + [{"text": q}], policy))[1]
    composed = ask("fast", "Who keeps unit 13 tidy?")
    assert composed.plan.approx and len(composed.plan.steps) > 1
    assert len(composed.plan.prefix_ids) >= PROMPT_BLOCK
    again = ask("fast", "And unit 26?")
    assert [s.kind for s in again.plan.steps] == [PlanKind.REUSE] and again.plan.steps[0].source == "context"
    assert again.plan.approx == composed.plan.approx and again.plan.prefix_ids == composed.plan.prefix_ids
    assert dict(again.sources)["reused"] == len(again.plan.prefix_ids)
    built = []
    build = b.pre.build
    b.pre.build = lambda *a, **kw: built.append(build(*a, **kw)) or built[-1]
    exact = ask("exact", "And unit 39?")                 # computes it exactly (its recipe is another)
    assert not exact.plan.approx and len(exact.plan.steps) > 1
    n = len(exact.plan.prefix_ids)
    exact_kv = built[-1][0].data[:, :, :, :n].clone()
    for policy in ("fast", "balanced", "exact"):
        fin = ask(policy, "And unit 52?")
        step = fin.plan.steps[0]
        assert [s.kind for s in fin.plan.steps] == [PlanKind.REUSE] and not fin.plan.approx, policy
        assert "exact context is held" in step.reason and dict(fin.sources)["reused"] == step.tokens == n
        assert torch.equal(built[-1][0].data[:, :, :, :n], exact_kv), policy     # the exact request's KV
    b.pre.build = build


def test_through_the_cluster_a_repeated_long_prompt_is_reused_and_reported_exactly(default_cluster):
    """Real actors: a long plain prompt sent once, then 4 requests sharing it sent at once: none
    recomputes the shared prefix, and each response's cached_tokens add up to exactly the
    router's prompt-token counters of the sources nobody computed."""
    from concurrent.futures import ThreadPoolExecutor

    http = default_cluster[1]     # the kept default cluster (reference decode), its tenant's key
    text = " ".join(f"Row {i} of the ledger reads {i * 17 % 89} crowns." for i in range(70))
    first = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": text + " Row 1?",
                                               "max_tokens": 2, "temperature": 0})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] > 2 * PROMPT_BLOCK

    def cached(m):
        return sum(metric(m, "kvnotes_prompt_tokens_total", source=s) for s in CACHED_SOURCES)

    m0 = http.get("/metrics").text

    def ask(i):
        r = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": text + f" Row {i + 2}?",
                                                "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(ask, range(4)))
    m1 = http.get("/metrics").text
    got = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert all(c >= 2 * PROMPT_BLOCK for c in got), got                  # none recomputed in full
    assert sum(got) == cached(m1) - cached(m0)                           # exactly what nobody computed
    computed = metric(m1, "kvnotes_prompt_tokens_total", source="computed") - \
        metric(m0, "kvnotes_prompt_tokens_total", source="computed")
    assert computed == sum(u["prompt_tokens"] for u in usages) - sum(got)
