"""The routing policies (pure) and the router's fault handling over real in-process executors:
decode by least outstanding tokens, prefill affinity within a load cap, dead workers skipped;
a worker lost before the first token is retried elsewhere (counted), a decode worker lost mid-stream
is replaced by another one (migrated, counted) and past its migrations is a clear error (counted), and a passed deadline stops the decode worker and answers 504 (counted)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.control.context import RequestContext
from cluster.control.errors import RequestError
from cluster.control.metrics import Metrics
from cluster.control.routing import NoLiveWorker, WorkerLost, WorkerView
from kvruntime.messages.decode import SamplingParams, TokenEvent
from kvtransport.transfer.endpoints import BlockKVSender
from kvtransport.transfer.grpc_transport import GrpcTransport
from tests.conftest import metric
from tests.test_router_fallback import LocalBackends, make_router


def test_decode_goes_to_least_outstanding_tokens_and_skips_dead_workers():
    v = WorkerView(1, 3)
    v.begin("decode", 0, 500)
    v.begin("decode", 1, 20)
    assert v.pick_decode() == 2
    v.begin("decode", 2, 40)
    assert v.pick_decode() == 1
    v.mark("decode", 1, False, "killed")
    assert v.pick_decode() == 2
    assert v.pick_decode(exclude={2}) == 0
    v.mark("decode", 0, False, "killed")
    with pytest.raises(NoLiveWorker, match="decode-0 \\(killed\\)"):
        v.pick_decode(exclude={2})
    v.mark("decode", 1, True)
    assert v.pick_decode() == 1 and v.snapshot()["decode"]["live"] == 2


def test_prefill_affinity_holds_when_idle_and_a_shared_key_spreads_under_load():
    v = WorkerView(2, 1)
    home = v.pick_prefill("shared-system-prompt")
    assert all(v.pick_prefill("shared-system-prompt") == home for _ in range(5))     # idle: sticky
    leases = [v.lease("prefill", v.pick_prefill("shared-system-prompt")) for _ in range(8)]
    per = [sum(1 for lease in leases if lease.index == i) for i in range(2)]
    assert per == [4, 4], per                                                     # concurrent: capped
    for lease in leases:
        lease.release()
        lease.release()                                                           # idempotent
    assert [w["in_flight"] for w in v.snapshot()["prefill"]["workers"]] == [0, 0]
    v.mark("prefill", home, False, "gone")
    assert v.pick_prefill("shared-system-prompt") == 1 - home
    with pytest.raises(ValueError):
        WorkerView(1, 1, prefill_load_factor=0.5)


class FlakyBackends(LocalBackends):
    """Two decode 'workers' over one real executor; ``lose`` says which one dies and when."""

    def __init__(self, engine, lose: dict[int, int], slow_s: float = 0.0):
        super().__init__(engine, BlockKVSender(GrpcTransport()))
        self.num_decode = 2
        self.lose, self.slow_s, self.cancelled, self.calls, self.continuations = lose, slow_s, [], [], []
        self.view = WorkerView(1, 2)

    cancels = True

    async def decode(self, index, job):
        self.calls.append(index)
        self.continuations.append(job.continuation)
        n = 0
        async for ev in super().decode(index, job):
            if index in self.lose and n == self.lose[index]:
                self.view.mark("decode", index, False, "killed")
                raise WorkerLost("decode", index, "ActorDiedError")
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            n += isinstance(ev, TokenEvent)
            yield ev

    async def cancel(self, index, key):
        self.cancelled.append((index, key))


async def _run(router, max_tokens=6, deadline_s=None):
    toks, fin = [], None
    async for ev in router.stream_native(RequestContext.local("default", deadline_s=deadline_s),
                                         [{"text": "The lighthouse on Hallo Point was built in 1871."}], session=None,
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0)):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def _router(smol, tmp_path, backends):
    from cluster.control.state import open_state
    return make_router(smol, backends, open_state(f"sqlite:///{tmp_path}/s-{id(backends)}.db"))


def test_worker_lost_before_first_token_is_retried_on_the_other_and_counted(smol, tmp_path):
    b = FlakyBackends(smol, lose={0: 0, 1: 0})
    b.view.mark("decode", 1, False, "restarting")          # only decode-0 looks alive, and it dies
    r = _router(smol, tmp_path, b)
    with pytest.raises(RequestError) as ei:
        asyncio.run(_run(r))
    assert ei.value.status == 503 and "no live decode worker" in ei.value.message
    b2 = FlakyBackends(smol, lose={0: 0})
    r2 = _router(smol, tmp_path, b2)
    b2.view.begin("decode", 1, 100)                        # decode-0 is the least loaded: picked first
    toks, fin = asyncio.run(_run(r2))
    assert fin is not None and len(toks) >= 1 and b2.calls == [0, 1]
    text = r2.metrics.render().decode()
    assert metric(text, "kvnotes_retries_total", role="decode", reason="lost_before_first_token") == 1
    assert metric(text, "kvnotes_requests_total", status="ok") == 1


class PrefillLostBackends(LocalBackends):
    """Two prefill 'workers' over one real executor; prefill-0 dies on its first call."""

    def __init__(self, engine):
        super().__init__(engine, BlockKVSender(GrpcTransport()))
        self.num_prefill, self.view, self.prefill_calls = 2, WorkerView(2, 1), []

    async def prefill(self, index, decode_index, job):
        self.prefill_calls.append(index)
        if index == 0:
            self.view.mark("prefill", 0, False, "killed")
            raise WorkerLost("prefill", 0, "ActorDiedError")
        return await super().prefill(index, decode_index, job)


def test_a_prefill_worker_lost_before_the_first_token_is_counted_as_a_prefill_retry(smol, tmp_path):
    b = PrefillLostBackends(smol)
    r = _router(smol, tmp_path, b)
    b.view.begin("prefill", 1, 100)                        # prefill-0 is the least loaded: picked first
    toks, fin = asyncio.run(_run(r))
    assert fin is not None and toks and b.prefill_calls == [0, 1]
    text = r.metrics.render().decode()
    assert metric(text, "kvnotes_retries_total", role="prefill", reason="lost_before_first_token") == 1
    assert metric(text, "kvnotes_retries_total", role="decode") == 0
    assert metric(text, "kvnotes_requests_total", status="ok", outcome="ok") == 1


def test_worker_lost_mid_stream_continues_on_the_other_worker_as_if_undisturbed(smol, tmp_path):
    ref_toks, ref = asyncio.run(_run(_router(smol, tmp_path, FlakyBackends(smol, lose={})), max_tokens=8))
    assert len(ref_toks) == 8 and ref.summary.finish_reason == "length"
    b = FlakyBackends(smol, lose={0: 3})
    r = _router(smol, tmp_path, b)
    b.view.begin("decode", 1, 100)                         # decode-0 is picked first, and dies after 3 tokens
    toks, fin = asyncio.run(_run(r, max_tokens=8))
    assert b.calls == [0, 1] and b.continuations[1].tokens == tuple(ref_toks[:3])
    assert toks == ref_toks                                 # one uninterrupted stream, the same tokens
    assert fin.summary.completion_tokens == 8 and fin.summary.finish_reason == "length"
    assert fin.summary.text == ref.summary.text and "decode_migrated" in fin.fallbacks
    text = r.metrics.render().decode()
    assert metric(text, "kvnotes_retries_total", role="decode", reason="migrated") == 1
    assert metric(text, "kvnotes_retries_total", role="decode", reason="lost_mid_stream") == 0
    assert metric(text, "kvnotes_requests_total", plan="recompute", status="ok") == 1
    assert metric(text, "kvnotes_fallbacks_total", reason="decode_migrated") == 1
    b.view.end("decode", 1, 100)
    assert all(w["in_flight"] == 0 for w in r.view.snapshot()["decode"]["workers"])


def test_worker_lost_mid_stream_past_its_migrations_is_a_clear_counted_error(smol, tmp_path):
    from cluster.control.routing import FaultPolicy
    for migrations, lose, after in ((1, {0: 2, 1: 2}, 4), (0, {0: 2, 1: 2}, 2)):
        b = FlakyBackends(smol, lose=lose)
        b.fault_policy = FaultPolicy(decode_migrations=migrations)
        r = _router(smol, tmp_path, b)
        got = []

        async def go():
            async for ev in r.stream_native(RequestContext.local("default"), [{"text": "Count: one, two, three,"}],
                                            session=None, sampling=SamplingParams(max_tokens=8, temperature=0)):
                got.append(ev)
        with pytest.raises(WorkerLost, match=f"mid-stream after {after} tokens.*send the request again"):
            asyncio.run(go())
        assert len(got) == after and len(b.calls) == migrations + 1
        text = r.metrics.render().decode()
        assert metric(text, "kvnotes_retries_total", role="decode", reason="lost_mid_stream") == 1
        assert metric(text, "kvnotes_retries_total", role="decode", reason="migrated") == migrations
        assert metric(text, "kvnotes_requests_total", status="worker_lost") == 1


def test_deadline_stops_the_decode_worker_and_answers_504(smol, tmp_path):
    """The request asks for a 4 s deadline (below the config default, 600 s)."""
    b = FlakyBackends(smol, lose={}, slow_s=1.5)
    r = _router(smol, tmp_path, b)
    assert r.fault.deadline_s == 600
    with pytest.raises(RequestError) as ei:
        asyncio.run(_run(r, max_tokens=20, deadline_s=4.0))
    assert ei.value.status == 504 and ei.value.code == "deadline_exceeded"
    assert len(b.cancelled) == 1 and b.cancelled[0][0] == b.calls[0]
    text = r.metrics.render().decode()
    assert metric(text, "kvnotes_deadline_exceeded_total", stage="decode") == 1
    assert metric(text, "kvnotes_requests_total", status="deadline") == 1
    assert all(w["in_flight"] == 0 for w in r.view.snapshot()["decode"]["workers"])


def test_fault_settings_are_validated_and_auth_mode_follows_the_token_file(tmp_path, monkeypatch):
    from cluster.operator.launcher import ray_auth_mode
    from kvruntime.config import ClusterConfig

    for bad in ({"worker_max_restarts": -2}, {"request_retries": -1}, {"health_period_s": 0},
                {"prefill_load_factor": 0.9}, {"request_deadline_s": 0}, {"ray_auth_mode": "tls"}):
        with pytest.raises(ValueError):
            ClusterConfig.from_dict(bad)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    token = tmp_path / "auth_token"
    assert ray_auth_mode(ClusterConfig(), token) is None
    token.write_text("x" * 32)
    assert ray_auth_mode(ClusterConfig(), token) == "token"
    assert ray_auth_mode(ClusterConfig.of(ray_auth_mode="disabled"), token) == "disabled"
