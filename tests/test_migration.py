"""Decode migration and prefill cancellation (a worker that dies mid-request).

- Decode side, real engine: a continuation (prompt + the tokens already streamed, from step k)
  yields exactly the events an undisturbed run yields from step k on: seeded sampling, penalties,
  stop strings spanning the boundary, log-probs, ``max_tokens`` and the summary's counts.
- Prefill side, real engine: a plan cancelled while it runs stops between layers (the number of
  layers it ran is counted, not timed).
- Real cluster (1 prefill + 2 decode Ray actors, the router under Serve): a decode actor SIGKILLed
  by PID under 32 concurrent greedy streams: every stream ends with a finish_reason and no in-band
  error, the text equals an undisturbed run's, ``kvnotes_retries_total{reason="migrated"}`` grew;
  a prefill past its request's deadline is stopped by its worker (the worker's counter grew).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import random

import httpx
import pytest

from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent
from tests.conftest import free_port, metric

PROMPT = "The lighthouse keeper wrote in his log every night. On the first night of winter he wrote:"


def _run(ex, prompt_ids, sampling, cont=None):
    evs = list(ex.generate(None, tuple(prompt_ids[:-4]), tuple(prompt_ids[-4:]), sampling, continuation=cont))
    return [e for e in evs if isinstance(e, TokenEvent)], evs[-1]


@pytest.fixture(scope="module")
def executor(smol, one_torch_thread):
    from decode_workers.executor import DecodeExecutor
    from kvtransport.transfer.grpc_transport import GrpcTransport
    return DecodeExecutor(smol, GrpcTransport(), receive_timeout=1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.8,
                   frequency_penalty=0.6, logprobs=2),
    SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=1.5, logprobs=1),
], ids=["seeded_penalties", "greedy_penalty"])
def test_a_continuation_yields_what_an_undisturbed_run_yields(smol, executor, sampling):
    ids = smol.tokenizer.encode(PROMPT)
    full, summ = _run(executor, ids, sampling)
    assert len(full) == 14 and summ.completion_tokens == 14
    for k in (1, 5, 13):
        cont = Continuation(tuple(e.token_id for e in full[:k]), "".join(e.text for e in full[:k]))
        rest, s = _run(executor, ids, sampling, cont)
        assert [(e.token_id, e.text, e.index) for e in rest] == [(e.token_id, e.text, e.index) for e in full[k:]], k
        assert [e.top_logprobs[0][0] for e in rest] == [e.top_logprobs[0][0] for e in full[k:]]
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(rest, full[k:]))
        assert (s.completion_tokens, s.finish_reason, s.text) == (summ.completion_tokens, summ.finish_reason,
                                                                 summ.text)
    # a different seed draws differently: the equality above is the continuation's, not the prompt's
    other, _ = _run(executor, ids, dataclasses.replace(sampling, seed=99))
    assert sampling.temperature == 0 or [e.token_id for e in other] != [e.token_id for e in full]


def test_a_stop_string_spanning_the_boundary_still_stops(smol, executor):
    ids = smol.tokenizer.encode(PROMPT)
    free, _ = _run(executor, ids, SamplingParams(max_tokens=16))
    text = "".join(e.text for e in free)
    at = len(text) // 2
    stop = text[at:at + 10]                                      # 10 characters in the middle of the output
    at = text.find(stop)
    sp = SamplingParams(max_tokens=16, stop=(stop,))
    full, summ = _run(executor, ids, sp)
    assert summ.finish_reason == "stop" and summ.text == text[:at] and len(full) < 16
    # cut before the token that completes the stop string, after the one that starts it: the
    # lost worker held part of it back
    k = len(full) - 1
    assert len(smol.decode([e.token_id for e in full[:k]])) > at
    cont = Continuation(tuple(e.token_id for e in full[:k]), "".join(e.text for e in full[:k]))
    rest, s = _run(executor, ids, sp, cont)
    assert [(e.token_id, e.text) for e in rest] == [(e.token_id, e.text) for e in full[k:]]
    assert (s.finish_reason, s.text, s.completion_tokens) == ("stop", summ.text, summ.completion_tokens)
    # the lost worker had streamed every token: only the summary is left to say
    cont = Continuation(tuple(e.token_id for e in full), "".join(e.text for e in full))
    rest, s = _run(executor, ids, sp, cont)
    assert rest == [] and isinstance(s, DecodeSummary) and (s.finish_reason, s.text) == ("stop", summ.text)


def test_a_prefill_cancelled_while_it_runs_stops_between_layers(smol, one_torch_thread):
    """The cancel flag goes up after the 3rd layer of the plan's forward: the build stops there
    (the layers run are counted by a hook), nothing is sent."""
    from kvruntime.engine import Cancelled
    from kvruntime.messages.plan import PlanKind, Policy, RequestPlan, SegmentPlan
    from prefill_workers.executor import PrefillExecutor
    from tests.conftest import DictSource

    class NoSend:
        def send(self, *a, **kw):
            raise AssertionError("a cancelled plan sends nothing")
    ids = tuple(smol.tokenizer.encode(PROMPT * 4))
    plan = RequestPlan("r1", smol.spec.name, Policy.EXACT,
                       (SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=ids, position=0,
                                    computed=len(ids), reused=0),), (ids[-1],))
    ran = []
    hooks = [layer.register_forward_hook(lambda *_: ran.append(1)) for layer in smol.model.model.layers]
    try:
        ex = PrefillExecutor(smol, DictSource(smol), NoSend())
        with pytest.raises(Cancelled):
            ex.execute(plan, "127.0.0.1:1", "t1", cancelled=lambda: len(ran) >= 3)
        assert len(ran) == 3 < smol.num_layers
        ran.clear()
        kv, _ = ex.build(plan, cancelled=lambda: False)              # not cancelled: every layer runs
        assert len(ran) == smol.num_layers and kv.num_tokens == len(ids)
    finally:
        for h in hooks:
            h.remove()


# ---- the real cluster ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def migration_cluster(tmp_path_factory, local_ray):
    """1 prefill + 2 decode actors and the router (test_faults' cluster without its lm:// tier,
    which plays no part here); stopped by the launcher, every wait bounded."""
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig, WorkerConfig
    from tests.test_faults import _headers, _wait

    root = tmp_path_factory.mktemp("kvmigrate")
    cfg = ClusterConfig.of(port=free_port(), tier_cpu_bytes=96 << 20, data_dir=str(root / "data"),
                        prefill=WorkerConfig(count=1), decode=WorkerConfig(count=2), decode_migrations=1,
                        health_period_s=0.5, health_timeout_s=5.0, worker_max_restarts=5,
                        # bursts of 16-32 streams queue past the default admission budget on this
                        # 2-core machine: admitted all the same (tests/test_overload.py covers shedding)
                        max_queue_wait_s=600.0,
                        # the reference run and the disturbed run build each prompt's KV the same way
                        # (prefill, or its tier copy): a decode-held prefix would compute the rest in
                        # other chunks, whose fp32 rounding can flip a greedy near-tie on its own
                        decode_prefix_cache_bytes=0)
    try:
        start(cfg, local_cpus=4)
        http = httpx.Client(base_url=f"http://127.0.0.1:{cfg.server.port}", timeout=300, headers=_headers(cfg))

        def ready():
            try:
                return http.get("/ready").status_code == 200
            except httpx.TransportError:
                return False
        _wait(ready, 180, "/ready")
        yield cfg, http, None
        http.close()
    finally:
        stop(cfg)


def _stream(http, prompt: str, max_tokens: int = 24, out: dict | None = None) -> dict:
    """One streamed completion: its text, finish_reason, usage, and any in-band error (``out``
    is filled as the events arrive)."""
    out = {} if out is None else out
    out.update({"text": "", "finish": None, "error": None, "usage": None, "events": 0})
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            c = ev["choices"][0]
            out["text"] += c.get("text") or ""
            out["events"] += 1
            out["finish"] = c.get("finish_reason") or out["finish"]
            out["usage"] = ev.get("usage") or out["usage"]
    return out


@pytest.mark.slow
def test_decode_actor_killed_under_32_streams_every_stream_completes_unchanged(migration_cluster):
    from tests.test_faults import _all_alive, _health, _kill, _metrics, _wait

    cfg, http, _ = migration_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")
    prompts = [f"Story {i}: the lighthouse keeper counted the ships passing by. The first ship was" for i in range(32)]
    with cf.ThreadPoolExecutor(32) as ex:
        ref = list(ex.map(lambda p: _stream(http, p), prompts))
    assert all(r["error"] is None and r["finish"] for r in ref), ref
    before = _metrics(http)
    progress = [{"events": 0, "finish": None} for _ in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        futs = [ex.submit(_stream, http, p, 24, out) for p, out in zip(prompts, progress)]

        def streaming():
            # a reference decode actor streams one request at a time: two streams half-way through
            # mean both actors are mid-stream, so the one killed loses a stream after its first token
            mid = [p for p in progress if 1 <= p["events"] <= 12 and p["finish"] is None and p.get("error") is None]
            return len(mid) >= 2
        _wait(streaming, 300, "two streams half-way through", every=0.01)
        _, snap = _health(http)
        victim = max(snap["workers"]["decode"]["workers"], key=lambda w: w["in_flight"])
        _kill(victim["pid"])
        done, pending = cf.wait(futs, timeout=400)
    assert not pending, "streams hung after a decode worker died"
    got = [f.result() for f in futs]
    errors = [g["error"] for g in got if g["error"]]
    assert not errors, errors
    assert all(g["finish"] in ("stop", "length") for g in got), [g["finish"] for g in got]
    assert [g["text"] for g in got] == [r["text"] for r in ref]            # greedy: as if undisturbed
    assert [g["usage"]["completion_tokens"] for g in got] == [r["usage"]["completion_tokens"] for r in ref]
    after = _metrics(http)
    migrated = metric(after, "kvnotes_retries_total", role="decode", reason="migrated") - \
        metric(before, "kvnotes_retries_total", role="decode", reason="migrated")
    assert migrated > 0, {r: metric(after, "kvnotes_retries_total", role="decode", reason=r) -
                          metric(before, "kvnotes_retries_total", role="decode", reason=r)
                          for r in ("migrated", "lost_before_first_token", "lost_mid_stream")}
    assert metric(after, "kvnotes_retries_total", role="decode", reason="lost_mid_stream") == \
        metric(before, "kvnotes_retries_total", role="decode", reason="lost_mid_stream")
    _wait(lambda: _all_alive(http), 180, "the restarted decode worker to be alive again")


@pytest.mark.slow
def test_a_prefill_past_its_deadline_is_stopped_by_its_worker(migration_cluster):
    from tests.test_faults import _all_alive, _metrics, _wait

    cfg, http, _ = migration_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")

    def worker_cancels() -> float:
        targets = http.get("/metrics/targets").json()
        addrs = [t for g in targets if g["labels"].get("kvnotes_role") == "prefill" for t in g["targets"]]
        assert len(addrs) == 1, targets
        return sum(metric(httpx.get(f"http://{a}/metrics", timeout=10).text, "kvnotes_worker_prefill_cancelled_total")
                   for a in addrs)
    start = worker_cancels()
    rng = random.Random(7)
    words = ["harbour", "signal", "lantern", "tide", "keeper", "storm", "beacon", "rock", "gull", "night"]
    sent = 0
    for attempt in range(6):                   # until one deadline falls inside a running prefill (bounded)
        before = metric(_metrics(http), "kvnotes_cancels_total", role="prefill", reason="deadline")
        prompt = " ".join(rng.choice(words) for _ in range(1500))        # distinct: no tier hit
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                               "deadline_s": 0.4 + 0.2 * attempt})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        if metric(_metrics(http), "kvnotes_cancels_total", role="prefill", reason="deadline") > before:
            sent += 1
            break
    assert sent, "no deadline passed during a running prefill in 6 attempts"
    _wait(lambda: worker_cancels() > start, 60, "the prefill worker to stop the cancelled plan")
