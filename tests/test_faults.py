"""Worker faults on the real cluster (Ray actors, Serve router, LMCache with an lm:// tier server):
actors are SIGKILLed by PID, the tier server is stopped and restarted. Requests keep succeeding
(retried on another worker, counted), a stream whose decode worker dies goes on on another one,
/health shows the loss and the recovery, and prefill load spreads across actors despite one shared
system prompt. The same cluster serves tests/test_migration.py's cluster tests (a decode actor killed
under 32 streams, every stream unchanged; a prefill past its deadline stopped by its worker), at the
end. Every wait is bounded."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import cluster_port, free_port, metric
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

SKILL = ("Warranty policy: laptops carry a two-year warranty covering hardware faults. Batteries are covered for "
         "one year. Accidental damage is never covered, but an extended plan can be bought within 30 days.")


def _headers(cfg) -> dict:
    """Bearer key when the cluster wrote one (auth on); none otherwise."""
    p = Path(cfg.state.data_dir).expanduser() / "api_key"
    return {"Authorization": f"Bearer {p.read_text().strip()}"} if p.exists() else {}


def _wait(pred, timeout_s: float, what: str, every: float = 0.5):
    return wait_for(pred, timeout_s, what, every)


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory, local_ray):
    from cluster.control.ray_backends import tier_key_of
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig, WorkerConfig
    from kvtransport.tier.server import start_tier_server, stop_tier_server

    root = tmp_path_factory.mktemp("kvfaults")
    tier_port = free_port()
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=96 << 20, data_dir=str(root / "data"),
                        tier_remote_url=f"lm://127.0.0.1:{tier_port}", tier_remote_probe_s=0.5,
                        prefill=WorkerConfig(count=2), decode=WorkerConfig(count=2),
                        health_period_s=0.5, health_timeout_s=5.0, worker_max_restarts=5,
                        # bursts of 16-32 streams queue past the default admission budget on this
                        # 2-core machine: admitted all the same (tests/test_overload.py covers shedding)
                        max_queue_wait_s=600.0,
                        # these tests measure prefill routing and the tier: decode actors keep no prefix,
                        # so no repeat skips its prefill (tests/test_prompt_reuse.py covers that path)
                        decode_prefix_cache_bytes=0)
    key = tier_key_of(cfg)        # the tier server's key, derived from the cluster secret like the actors'
    tier = start_tier_server("127.0.0.1", tier_port, key=key, log_path=root / "tier.log")
    state = {"tier": tier, "tier_key": key}
    try:
        start(cfg, local_cpus=5)
        http = httpx.Client(base_url=f"http://127.0.0.1:{cfg.server.port}", timeout=180, headers=_headers(cfg))
        def ready():
            try:
                return http.get("/ready").status_code == 200
            except httpx.TransportError:
                return False
        _wait(ready, 120, "/ready")
        r = http.post("/v1/skills", json={"name": "warranty", "text": SKILL})
        assert r.status_code == 201, r.text
        yield cfg, http, state
        http.close()
    finally:
        try:
            stop(cfg)
        finally:
            stop_tier_server(state["tier"])


def _health(http) -> tuple[int, dict]:
    r = http.get("/health")
    return r.status_code, r.json()


def _worker(snap: dict, role: str, busy: bool = False) -> dict:
    ws = snap["workers"][role]["workers"]
    if busy:
        ws = [w for w in ws if w["in_flight"] > 0]
    assert ws, snap
    return ws[0]


def _all_alive(http, roles: tuple[str, ...] = ("prefill", "decode")) -> bool:
    """Every worker of ``roles`` alive (/health)."""
    code, snap = _health(http)
    return code == 200 and all(snap["workers"][r]["live"] == snap["workers"][r]["total"] for r in roles)


def _ask(http, q: str, max_tokens: int = 4) -> httpx.Response:
    return http.post("/v1/notes/completions", json={
        "segments": [{"skill": "warranty"}, {"text": q}], "max_tokens": max_tokens, "temperature": 0})


def _metrics(http) -> str:
    return http.get("/metrics").text


def _prefill_metrics(http) -> str:
    """Every prefill actor's own exporter (found through /metrics/targets), concatenated."""
    groups = http.get("/metrics/targets").json()
    return "\n".join(httpx.get(f"http://{g['targets'][0]}/metrics", timeout=10).text for g in groups
                     if g["labels"]["kvnotes_role"] == "prefill")


def _kill(pid: int) -> None:
    assert pid and pid != os.getpid()
    os.kill(pid, signal.SIGKILL)


def test_prefill_load_spreads_across_actors_with_a_shared_system_prompt(fault_cluster):
    """A 1k-token system prompt shared by every request: the affinity key is the same for all,
    the load cap spreads concurrent requests; prefill CPU time of the two actors within 50%."""
    import psutil

    cfg, http, _ = fault_cluster
    system = " ".join(f"Rule {i}: answer politely and briefly, cite the policy section number." for i in range(80))
    ntok = len(system.split()) * 1.3
    assert ntok > 900

    def chat(i: int) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"model": cfg.workers.model, "max_tokens": 2, "temperature": 0,
                                                       "messages": [{"role": "system", "content": system},
                                                                    {"role": "user", "content": f"Question {i}: hi?"}]})
    r = chat(-1)                                    # warm-up: the shared prefix lands in the tiers
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 900
    _, snap = _health(http)
    pids = [w["pid"] for w in snap["workers"]["prefill"]["workers"]]
    before = [sum(psutil.Process(p).cpu_times()[:2]) for p in pids]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(chat, range(12)))
    assert all(g.status_code == 200 for g in got), [g.text for g in got if g.status_code != 200]
    used = [sum(psutil.Process(p).cpu_times()[:2]) - b for p, b in zip(pids, before)]
    assert min(used) > 0
    # affinity alone would put ~all of it on one actor (a 90%+ gap); the load cap spreads it. CPU time
    # is noisy on 2 shared cores (one actor may also fetch the prefix from the lm:// tier): < 50% apart
    assert (max(used) - min(used)) / max(used) < 0.50, f"prefill CPU seconds per actor: {used}"


def test_decode_killed_mid_stream_continues_on_the_other_then_recovers(fault_cluster):
    cfg, http, _ = fault_cluster
    _wait(lambda: _all_alive(http), 120, "all workers alive")
    before = _metrics(http)
    # 40 tokens (was 80): the kill lands after the first token with most of the stream still to come,
    # the rest streams from the other actor; how many come after does not change what is asserted
    body = {"segments": [{"skill": "warranty"}, {"text": "Count from one to one hundred in words: one, two,"}],
            "max_tokens": 40, "temperature": 0, "stream": True}

    def lost():
        _, snap = _health(http)
        return snap["workers"]["decode"]["live"] == 1 and snap
    events, killed, snap = [], None, None
    with http.stream("POST", "/v1/notes/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if killed is None and "token" in ev:
                code, snap = _health(http)
                killed = _worker(snap, "decode", busy=True)
                _kill(killed["pid"])
                snap = _wait(lost, 30, "/health to show the dead decode worker")
                assert 'kvnotes_workers_alive{role="decode"} 1.0' in _metrics(http)
    assert killed is not None, events
    assert not any("error" in e for e in events), events[-1]                 # one uninterrupted stream
    assert events[-1].get("finish_reason") in ("stop", "length"), events[-1]
    assert events[-1]["usage"]["completion_tokens"] == body["max_tokens"] or events[-1]["finish_reason"] == "stop"
    after = _metrics(http)
    assert metric(after, "kvnotes_retries_total", role="decode", reason="migrated") == \
        metric(before, "kvnotes_retries_total", role="decode", reason="migrated") + 1
    assert metric(after, "kvnotes_retries_total", role="decode", reason="lost_mid_stream") == \
        metric(before, "kvnotes_retries_total", role="decode", reason="lost_mid_stream")
    dead = [w for w in snap["workers"]["decode"]["workers"] if not w["alive"]]
    assert [w["name"] for w in dead] == [killed["name"]]
    for i in range(20):
        r = _ask(http, f"Is a battery covered after {i + 13} months?")
        assert r.status_code == 200, (i, r.text)
    _wait(lambda: _all_alive(http), 180, "the restarted decode worker to be alive again")
    _, snap = _health(http)
    back = next(w for w in snap["workers"]["decode"]["workers"] if w["name"] == killed["name"])
    assert back["alive"] and back["pid"] not in (None, killed["pid"])        # a restarted process
    assert 'kvnotes_workers_alive{role="decode"} 2.0' in _metrics(http)


def test_prefill_killed_requests_and_registration_still_succeed(fault_cluster):
    cfg, http, _ = fault_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")
    _, snap = _health(http)
    victim = snap["workers"]["prefill"]["workers"][0]
    _kill(victim["pid"])
    r = http.post("/v1/skills", json={"name": "returns", "text": "Returns: 30 days, receipt required."})
    assert r.status_code == 201, r.text
    for i in range(20):
        r = _ask(http, f"Is accidental damage covered, case {i}?")
        assert r.status_code == 200, (i, r.text)
    code, snap = _health(http)
    assert code == 200 and snap["workers"]["prefill"]["live"] >= 1
    _wait(lambda: _all_alive(http), 180, "the restarted prefill worker to be alive again")


def test_one_of_two_decode_workers_killed_under_16_concurrent_requests(fault_cluster):
    cfg, http, _ = fault_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")
    before = _metrics(http)

    def one(i: int) -> httpx.Response:
        return _ask(http, f"Request {i}: how long is the laptop warranty?", max_tokens=12)

    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(one, i) for i in range(16)]
        def busy():
            _, snap = _health(http)
            return any(w["in_flight"] for w in snap["workers"]["decode"]["workers"]) and snap
        snap = _wait(busy, 60, "a busy decode worker", every=0.05)
        victim = _worker(snap, "decode", busy=True)
        _kill(victim["pid"])
        done, pending = cf.wait(futs, timeout=300)
    assert not pending, "requests hung after a decode worker died"
    results = [f.result() for f in futs]
    failed = [r for r in results if r.status_code != 200]
    for r in failed:          # a clear error: names the lost worker and says what to do
        msg = r.json()["error"]["message"]
        assert r.status_code in (500, 503) and "was lost" in msg and "send the request again" in msg, r.text
    after = _metrics(http)

    def delta(**labels):
        return metric(after, "kvnotes_retries_total", **labels) - metric(before, "kvnotes_retries_total", **labels)
    assert delta(role="decode", reason="lost_mid_stream") + delta(role="decode", reason="retries_exhausted") \
        == len(failed)
    assert delta(role="decode") >= 1            # the loss was seen and counted (retried or failed)
    assert len(failed) < 16


def test_remote_tier_down_and_back(fault_cluster):
    from kvtransport.tier.server import start_tier_server, stop_tier_server

    cfg, http, state = fault_cluster
    # the prefill actors (they probe the tier and count its misses); a decode actor the test before
    # killed restarts meanwhile (its model load overlaps this test, not a wait before it): requests
    # go to the live one, and the next test waits for every worker
    _wait(lambda: _all_alive(http, ("prefill",)), 180, "all prefill workers alive")
    gauge = lambda: metric(_metrics(http), "kvnotes_tier_remote_up")  # noqa: E731
    # a prefill actor restarted by an earlier test reports its first probe within seconds
    _wait(lambda: gauge() == 1.0, 30, "kvnotes_tier_remote_up to be 1 before the outage")
    old = state["tier"]
    stop_tier_server(old)
    # counted once, by the prefill actor whose lookup or get missed (not by each router replica)
    down = lambda: metric(_prefill_metrics(http), "kvnotes_fallbacks_total", reason="tier_remote_down")  # noqa: E731
    down0 = down()
    assert metric(_metrics(http), "kvnotes_fallbacks_total", reason="tier_remote_down") == 0
    # registered while the remote is down: the lookup misses there, the chunk is compiled (counted)
    r = http.post("/v1/skills", json={"name": "outage", "text": "Outage policy: we refund the fee for any outage "
                                                                "longer than four hours, on request."})
    assert r.status_code == 201 and not r.json()["cached"], r.text
    for i in range(6):
        r = http.post("/v1/notes/completions", json={"segments": [{"skill": "outage"}, {"text": f"Refund {i}?"}],
                                                     "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    _wait(lambda: gauge() == 0.0, 30, "kvnotes_tier_remote_up to drop to 0")
    _wait(lambda: down() > down0, 30, "the recompute a down remote tier caused to be counted")
    state["tier"] = start_tier_server(old.host, old.port, key=state["tier_key"], log_path=old.log_path)

    def back():
        _ask(http, "Is the battery covered?")
        return gauge() == 1.0
    # the actors probe every tier_remote_probe_s (0.5 s here): the gauge follows within seconds
    _wait(back, 20, "kvnotes_tier_remote_up to come back to 1", every=1.0)


# ---- decode migration under load, prefill cancellation (module doc of tests/test_migration.py) -------
# On this module's cluster: a cluster of their own (1 prefill + 2 decode actors, no lm:// tier)
# cost one more cluster start; what they assert holds the same with 2 prefill actors and the tier.

def _stream(http, prompt: str, max_tokens: int, out: dict | None = None) -> dict:
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


# tokens per stream: the kill lands while both actors are at most half-way through a stream (so
# the victim loses one after its first token, with at least half of it still to come), every
# stream is then compared whole with the undisturbed run; the property does not depend on the
# length, which was 24, then 16 (both rounds of 32 streams decode every token on 2 actors one
# stream at a time, the second mostly on the survivor: nearly all of this test's time)
MIGRATION_TOKENS = 8


def test_decode_actor_killed_under_32_streams_every_stream_completes_unchanged(fault_cluster):
    cfg, http, _ = fault_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")
    prompts = [f"Story {i}: the lighthouse keeper counted the ships passing by. The first ship was" for i in range(32)]
    with cf.ThreadPoolExecutor(32) as ex:
        ref = list(ex.map(lambda p: _stream(http, p, MIGRATION_TOKENS), prompts))
    assert all(r["error"] is None and r["finish"] for r in ref), ref
    before = _metrics(http)
    progress = [{"events": 0, "finish": None} for _ in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        futs = [ex.submit(_stream, http, p, MIGRATION_TOKENS, out) for p, out in zip(prompts, progress)]

        def streaming():
            # a reference decode actor streams one request at a time: two streams half-way through
            # mean both actors are mid-stream, so the one killed loses a stream after its first token
            mid = [p for p in progress if 1 <= p["events"] <= MIGRATION_TOKENS // 2 and p["finish"] is None
                   and p.get("error") is None]
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


def test_a_prefill_past_its_deadline_is_stopped_by_its_worker(fault_cluster):
    import random

    cfg, http, _ = fault_cluster
    _wait(lambda: _all_alive(http), 180, "all workers alive")

    def worker_cancels() -> float:
        """Summed over the prefill actors' own exporters: whichever ran the plan stopped it."""
        targets = http.get("/metrics/targets").json()
        addrs = [t for g in targets if g["labels"].get("kvnotes_role") == "prefill" for t in g["targets"]]
        assert len(addrs) == cfg.workers.prefill.count, targets
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
