"""Ship nothing twice, reference decode engine: the decode executor keeps each request's prefix KV
(byte-bounded LRU keyed by token ids + salt), the grant of the next request with that prefix is
narrowed to the tail, and the held slots joined with the received tail decode exactly like a
recompute. Real model, real gRPC receiver with grants, real Prometheus exposition."""
import threading
import time
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from cluster.control.planner import RenderedRequest, TierView, plan_request
from decode_workers.executor import DecodeExecutor
from decode_workers.held_kv import HeldPrefixes
from decode_workers.metrics import HeldCollector
from kvruntime.kv import KVCache
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvruntime.messages.keys import token_hash
from kvruntime.messages.plan import Policy
from kvruntime.messages.transfer import TransferGrant
from kvruntime.ops import recompute
from kvtransport.transfer.endpoints import Receiver, Sender
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource, metric
from tests.test_executors import _segments


def _kv(ids, fill=0.0) -> KVCache:
    n = len(ids)
    return KVCache(torch.full((2, 2, 1, n, 4), fill), torch.arange(n), torch.tensor(ids, dtype=torch.long))


def _exposition(held) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(HeldCollector(held, "decode-0"))
    return generate_latest(reg).decode()


def test_held_prefixes_match_by_salt_extend_and_evict_counted():
    held = HeldPrefixes(1 << 20)
    a = tuple(range(1, 11))
    assert held.put(a, "tenant-a", _kv(a))
    assert held.held_prefix(a + (50, 51), "tenant-a") == 10
    assert held.held_prefix(a + (50, 51), "tenant-b") == 0            # another tenant's salt never matches
    assert held.held_prefix((1, 2, 3, 99), "tenant-a") == 3           # the longest common leading run
    longer = a + tuple(range(20, 30))
    assert held.put(longer, "tenant-a", _kv(longer))                   # extends the entry: replaces it
    s = held.stats()
    assert (s.entries, s.held_bytes, s.evictions) == (1, _kv(longer).nbytes, 0)
    assert held.put(a, "tenant-a", _kv(a)) and held.stats().entries == 1   # covered by the longer entry

    tiny = HeldPrefixes(_kv(a).nbytes + 8)                             # room for one entry
    assert tiny.put(a, "s", _kv(a, 1.0))
    assert tiny.hold("t-1", a + (7,), "s", limit=10) == 10            # pinned for transfer t-1
    b = tuple(range(100, 110))
    assert tiny.put(b, "s", _kv(b))                                    # evicts a (LRU), counted
    s = tiny.stats()
    assert (s.entries, s.evictions, s.held_bytes) == (1, 1, _kv(b).nbytes)
    assert tiny.held_prefix(a, "s") == 0
    pinned = tiny.take("t-1")                                          # the pin outlives the eviction
    assert pinned.token_ids.tolist() == list(a) and float(pinned.data[0, 0, 0, 0, 0]) == 1.0
    assert tiny.take("t-1") is None
    assert not tiny.put(tuple(range(40)), "s", _kv(tuple(range(40))))  # larger than the budget: not kept
    text = _exposition(tiny)
    assert metric(text, "kvnotes_decode_prefix_evictions_total", worker="decode-0") == 1
    assert metric(text, "kvnotes_decode_prefix_held_bytes", worker="decode-0") == _kv(b).nbytes
    with pytest.raises(ValueError):
        HeldPrefixes(-1)


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


def _request(e, rx, pre, dec, plan, salt, max_tokens=10):
    """What the router and DecodeWorker.expect do: grant, narrow by what is held, send, decode."""
    tid = uuid.uuid4().hex
    prefix = plan.prefix_ids
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", prefix)
    held = dec.held_prefix(prefix, salt, transfer_id=tid, limit=grant.tokens - 1)
    if held:
        grant = TransferGrant(grant.transfer_id, grant.credential_sha256, grant.model, grant.dtype,
                              grant.tokens - held, held, token_hash(prefix[held:]))
    rx.expect(grant)
    res = pre.execute(plan, rx.endpoint, tid, credential=cred, send_from=held)
    events = list(dec.generate(tid if res.transferred else None, prefix, plan.suffix_ids,
                               SamplingParams(max_tokens=max_tokens), salt=salt))
    return held, res, [ev.token_id for ev in events if isinstance(ev, TokenEvent)], events[-1]


@pytest.mark.slow
def test_a_held_prefix_is_not_sent_again_and_decodes_like_recompute(wired):
    e, rx, pre = wired
    dec = DecodeExecutor(e, rx, receive_timeout=10, held=HeldPrefixes(64 << 20))
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    held0, first, toks0, sum0 = _request(e, rx, pre, dec, plan, "salt-a")
    assert held0 == 0 and first.transferred and sum0.fallbacks == () and sum0.loaded_tokens == len(plan.prefix_ids)
    held1, second, toks1, sum1 = _request(e, rx, pre, dec, plan, "salt-a")
    n = len(plan.prefix_ids)
    assert held1 == n - 1 and second.transferred and sum1.fallbacks == ()
    assert second.transfer_bytes < first.transfer_bytes / 2, (first.transfer_bytes, second.transfer_bytes)
    assert sum1.cached_tokens == n and sum1.loaded_tokens == 1
    full = recompute(e, list(plan.prefix_ids + plan.suffix_ids))
    oracle = [t for t in e.greedy(full.kv, full.logits, 10, stop_at_eos=True) if t not in e.eos_ids]
    assert toks1 == toks0 == oracle
    # the same text under another salt (another tenant): nothing reused, everything sent
    held2, third, toks2, _ = _request(e, rx, pre, dec, plan, "salt-b")
    assert held2 == 0 and third.transfer_bytes == first.transfer_bytes and toks2 == oracle


@pytest.mark.slow
def test_a_pin_lost_before_decode_is_a_counted_recompute(wired):
    e, rx, pre = wired
    dec = DecodeExecutor(e, rx, receive_timeout=10, held=HeldPrefixes(64 << 20))
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    _, _, toks0, _ = _request(e, rx, pre, dec, plan, "s")
    tid = uuid.uuid4().hex
    prefix = plan.prefix_ids
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", prefix)
    held = dec.held_prefix(prefix, "s", transfer_id=tid, limit=grant.tokens - 1)
    assert held == len(prefix) - 1
    rx.expect(TransferGrant(tid, grant.credential_sha256, grant.model, grant.dtype, 1, held, token_hash(prefix[held:])))
    assert pre.execute(plan, rx.endpoint, tid, credential=cred, send_from=held).transferred
    dec.held.take(tid)                                                  # the pin is gone (dropped)
    events = list(dec.generate(tid, prefix, plan.suffix_ids, SamplingParams(max_tokens=10), salt="s"))
    assert events[-1].fallbacks == ("kv_held_missing",)
    assert [ev.token_id for ev in events if isinstance(ev, TokenEvent)] == toks0


class _GatedHeld(HeldPrefixes):
    """A held cache whose put blocks until the test opens ``gate`` (bounded): shows whether the
    first token came out before the held copy was stored."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.putting = threading.Event(), threading.Event()

    def put(self, prefix_ids, salt, kv):
        self.putting.set()
        if not self.gate.wait(30):
            raise TimeoutError("gate never opened")
        return super().put(prefix_ids, salt, kv)


def _until(cond, limit=30.0):
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


@pytest.mark.slow
def test_the_held_copy_runs_after_the_first_token_and_a_lookup_meanwhile_waits_for_it(wired):
    e, rx, pre = wired
    held = _GatedHeld(64 << 20)
    dec = DecodeExecutor(e, rx, receive_timeout=10, held=held)
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    prefix, n = plan.prefix_ids, len(plan.prefix_ids)
    tid = uuid.uuid4().hex
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", prefix)
    rx.expect(grant)
    assert pre.execute(plan, rx.endpoint, tid, credential=cred).transferred
    gen = dec.generate(tid, prefix, plan.suffix_ids, SamplingParams(max_tokens=10), salt="s")
    first = next(gen)
    # the first token is out while nothing is stored yet (the received block as is: a copy is due)
    assert isinstance(first, TokenEvent) and not held.gate.is_set() and held.stats().entries == 0
    second = next(gen)                                       # the copy has started, blocked in put
    assert held.putting.wait(30)
    seen = []
    lookup = threading.Thread(target=lambda: seen.append(dec.held_prefix(prefix, "s")))
    lookup.start()
    _until(lambda: held.stats().copy_waits == 1)             # the lookup waits for the copy ...
    held.gate.set()
    lookup.join(30)
    assert seen == [n]                                       # ... and then sees it whole
    rest = [second] + list(gen)
    summary = rest[-1]
    assert "held_copy" in dict(summary.stages) and summary.fallbacks == ()
    toks0 = [first.token_id] + [ev.token_id for ev in rest if isinstance(ev, TokenEvent)]
    # a request right after is sent one token and decodes exactly like a recompute
    held1, res, toks1, sum1 = _request(e, rx, pre, dec, plan, "s")
    assert held1 == n - 1 and res.transferred and sum1.fallbacks == () and sum1.cached_tokens == n
    full = recompute(e, list(plan.prefix_ids + plan.suffix_ids))
    oracle = [t for t in e.greedy(full.kv, full.logits, 10, stop_at_eos=True) if t not in e.eos_ids]
    assert toks1 == toks0 == oracle
    s = held.stats()
    assert (s.copy_waits, s.copy_wait_timeouts) == (1, 0)
    text = _exposition(held)
    assert metric(text, "kvnotes_decode_prefix_copy_waits_total", worker="decode-0") == 1
    assert metric(text, "kvnotes_decode_prefix_copy_wait_timeouts_total", worker="decode-0") == 0


@pytest.mark.slow
def test_a_request_cancelled_after_its_first_token_still_keeps_its_prefix(wired):
    e, rx, pre = wired
    dec = DecodeExecutor(e, rx, receive_timeout=10, held=HeldPrefixes(64 << 20))
    frame, skill, q = _segments(e)
    plan = plan_request(RenderedRequest("r", e.spec.name, Policy.EXACT, (frame, skill), q), TierView(), None, e.encode)
    tid = uuid.uuid4().hex
    grant, cred = TransferGrant.issue(tid, plan.model, "float32", plan.prefix_ids)
    rx.expect(grant)
    assert pre.execute(plan, rx.endpoint, tid, credential=cred).transferred
    gen = dec.generate(tid, plan.prefix_ids, plan.suffix_ids, SamplingParams(max_tokens=10), salt="s")
    assert isinstance(next(gen), TokenEvent)
    gen.close()                                              # what DecodeWorker.generate does on cancel
    assert dec.held_prefix(plan.prefix_ids, "s") == len(plan.prefix_ids)   # waits for the copy, bounded


@pytest.mark.slow
def test_a_growing_prompt_is_stored_behind_from_the_previous_turn_through_the_real_cluster(default_cluster):
    """The real cluster, reference decode: turn 0 is built and stored by the prefill worker; the
    decode actor holds its prefix, so it computes turn 1's rest itself, and store-behind compiles
    only turn 1's part past turn 0's stored prefix on the prefill actor (``stored_delta``). The
    router's decode-held record sits in the state store under the decode actor's incarnation (the
    boot id its health answers and its summaries carry)."""
    import ray

    from cluster.control.decode_held import DecodeHeld
    from cluster.control.ray_backends import NAMESPACE
    from cluster.control.routing import WorkerView
    from cluster.control.state import open_state

    cfg, http = default_cluster
    ids = [(i * 7919 + 13) % 40000 + 100 for i in range(900)]          # this test's own tokens
    stores = lambda: metric(http.get("/metrics").text, "kvnotes_prompt_stores_total", outcome="stored_delta")  # noqa: E731
    before = stores()
    for n in (600, 900):
        r = http.post("/v1/completions", json={"prompt": ids[:n], "max_tokens": 2, "temperature": 0,
                                               "kv_policy": "exact"})
        assert r.status_code == 200, r.text
    deadline = time.time() + 120
    while stores() < before + 1 and time.time() < deadline:             # stored behind, after the answer
        time.sleep(0.5)
    assert stores() == before + 1
    boot = ray.get(ray.get_actor("decode-0", namespace=NAMESPACE).health.remote())["boot"]
    view = WorkerView(1, 1)
    view.workers["decode"][0].boot = boot
    s = open_state(cfg.state.resolved_url)
    try:
        seen = DecodeHeld(s, view).lookup(cfg.server.tenant, ids)
        assert (seen.tokens, seen.engine) == (900, f"decode-0@{boot}") and 600 in seen.ends
        view.workers["decode"][0].boot = "another"                     # a restarted actor: its cache is empty
        assert DecodeHeld(s, view).longest(cfg.server.tenant, ids) == 0
    finally:
        s.close()
