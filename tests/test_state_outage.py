"""State-store outages: a real redis-server (AOF on, as docs/deploy.md recommends) on a
free loopback port is SIGKILLed by PID and restarted on the same port. Every store method then
raises ``StateStoreUnavailable``; an API key validated within ``auth_cache_s`` keeps working, an
unknown-to-the-cache one is a 503 ``state_store_unavailable`` with ``Retry-After``; the replica's
probe drives ``kvnotes_state_store_up``, ``/ready`` and ``/health``. The cluster test does the same
under load on the real embedded cluster (2 router replicas): no HTTP 500 at all. Every wait is
bounded; processes are stopped by PID."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from cluster.control.state import StateStoreUnavailable, StoreLimits, open_state
from tests.conftest import cluster_port, free_port, http_client, metric
from tests.test_faults import _wait

# one prefill and one decode actor of SmolLM2 with a 128 MiB tier, as in the other modules of this unit
# (tests/conftest.py: their actors are started once and taken over from one module's cluster to the next)
WORKERS_UNIT = "smollm2-tier128"


class RedisProc:
    """A redis-server with AOF (appendonly yes, appendfsync everysec) that can be SIGKILLed and
    started again on the same port and directory."""

    def __init__(self, root):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.fail("redis-server is not installed (scripts/dev.sh test installs Debian's redis-server)")
        self.dir, self.port, self.proc = root, free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis
        r = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            _wait(lambda: self.proc.poll() is not None or _pings(r), 15, "redis-server to answer", every=0.05)
        finally:
            r.close()
        assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"

    def wait_written(self, timeout_s: float = 10.0) -> None:
        """Until every write so far is in the AOF file (write() done: a SIGKILL no longer loses it;
        appendfsync everysec may hold writes back for up to ~2 s, which a crash would lose): a
        marker written now reaches the file after every earlier command."""
        import redis
        marker = "aof-marker-" + os.urandom(8).hex()
        r = redis.Redis(port=self.port, socket_timeout=2)
        try:
            r.set("kvn-test:aof-marker", marker)
        finally:
            r.close()
        _wait(lambda: marker.encode() in b"".join(p.read_bytes() for p in self.dir.rglob("*.aof")), timeout_s,
              "the AOF to hold every write so far", every=0.05)

    def kill(self) -> None:
        """SIGKILL by PID: no shutdown, no final save."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def _pings(r) -> bool:
    import redis
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def redis_proc(tmp_path):
    rp = RedisProc(tmp_path)
    rp.start()
    yield rp
    rp.stop()


# ---- the store, the key cache and the probe, without a cluster -----------------------------------

def test_every_store_call_raises_state_store_unavailable_and_aof_keeps_the_data(redis_proc):
    from cluster.http.auth import create_key, hash_key
    s = open_state(redis_proc.url, StoreLimits(timeout_s=1.0))
    seen = []
    s.on_unavailable = lambda op, exc: seen.append(op)
    key, rec = create_key(s, "acme")
    secret = s.secret()
    redis_proc.wait_written()
    redis_proc.kill()
    calls = {"ping": lambda: s.ping(), "api_key": lambda: s.api_key(hash_key(key)),
             "get_prompt_blocks": lambda: s.get_prompt_blocks("acme", ["h"], time.time()),
             "list_registrations": lambda: s.list_registrations("acme", "skill"),
             "put_session": lambda: s.put_session("acme", "s1", "{}", time.time()),
             "get_decode_held": lambda: s.get_decode_held("acme", ["decode-0@b|h"], time.time()),
             "put_decode_held": lambda: s.put_decode_held("acme", {"decode-0@b|h": 64}, time.time()),
             "sizes": lambda: s.sizes(time.time())}
    for op, call in calls.items():
        with pytest.raises(StateStoreUnavailable) as err:
            call()
        assert err.value.op == op and "does not answer" in str(err.value)
    assert seen == list(calls)                       # each failure reported once, by its operation
    redis_proc.start()                               # same port, same AOF file
    assert s.api_key(hash_key(key)) == rec           # the stale pooled connection is replaced at once
    assert s.secret() == secret
    s.close()


def test_validated_keys_are_cached_for_auth_cache_s_and_revocation_takes_effect_within_it(redis_proc):
    from cluster.control.errors import RequestError
    from cluster.http.auth import Authenticator, create_key

    s = open_state(redis_proc.url, StoreLimits(timeout_s=1.0))
    seen, other = create_key(s, "acme"), create_key(s, "globex")
    redis_proc.wait_written()
    auth = Authenticator(s, enabled=True, default_tenant="default", cache_s=60.0)
    hdr = lambda k: {"authorization": f"Bearer {k}"}       # noqa: E731
    assert auth.tenant(hdr(seen[0]), "127.0.0.1") == "acme"
    redis_proc.kill()
    assert auth.tenant(hdr(seen[0]), "127.0.0.1") == "acme"        # cached: no store read
    with pytest.raises(StateStoreUnavailable):
        auth.tenant(hdr(other[0]), "127.0.0.1")                     # never validated here: must ask the store
    with pytest.raises(StateStoreUnavailable):                      # no cache at all
        Authenticator(s, enabled=True, default_tenant="default", cache_s=0).tenant(hdr(seen[0]), None)
    redis_proc.start()
    assert auth.tenant(hdr(other[0]), "127.0.0.1") == "globex"

    # revocation: honoured from cache until auth_cache_s passes, then refused
    short = Authenticator(s, enabled=True, default_tenant="default", cache_s=0.5)
    assert short.tenant(hdr(seen[0]), None) == "acme"
    assert s.revoke_api_key(seen[1].key_id)
    assert short.tenant(hdr(seen[0]), None) == "acme"
    time.sleep(0.6)
    with pytest.raises(RequestError) as err:
        short.tenant(hdr(seen[0]), None)
    assert err.value.status == 401
    # the cache is bounded: beyond cache_max the oldest entries go
    small = Authenticator(s, enabled=True, default_tenant="default", cache_s=60.0, cache_max=2)
    keys = [create_key(s, f"t{i}")[0] for i in range(3)]
    assert [small.tenant(hdr(k), None) for k in keys] == ["t0", "t1", "t2"]
    assert len(small._cache) == 2
    s.close()


def test_the_probe_drives_the_gauge_and_the_error_is_a_503_with_retry_after(redis_proc):
    from cluster.control.metrics import Metrics
    from cluster.control.state.watch import StoreWatch
    from cluster.http.errors import error_response

    s = open_state(redis_proc.url, StoreLimits(timeout_s=1.0))
    m = Metrics()
    w = StoreWatch(s, m, period_s=1.0, start=False)
    up = lambda: metric(m.render().decode(), "kvnotes_state_store_up")   # noqa: E731
    assert w.probe() and w.snapshot()["up"] and up() == 1
    redis_proc.kill()
    assert not w.probe()
    snap = w.snapshot()
    assert not snap["up"] and "does not answer" in snap["error"] and up() == 0
    assert metric(m.render().decode(), "kvnotes_state_store_errors_total", op="ping") == 1
    with pytest.raises(StateStoreUnavailable) as err:                # a request's failure is seen too
        s.get_template("acme", "x")
    assert metric(m.render().decode(), "kvnotes_state_store_errors_total", op="get_template") == 1
    r = error_response(err.value, "req-1")
    body = json.loads(r.body)["error"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert body["code"] == "state_store_unavailable" and body["request_id"] == "req-1"
    redis_proc.start()
    assert w.probe() and w.snapshot() == {"up": True, "error": "", "down_for_s": 0.0} and up() == 1
    s.close()


# ---- the real cluster under load -------------------------------------------------------------------

@pytest.fixture(scope="module")
def outage_cluster(tmp_path_factory, local_ray):
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig

    root = tmp_path_factory.mktemp("kvoutage")
    rp = RedisProc(root)
    rp.start()
    try:
        cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, router_replicas=2, data_dir=str(root / "data"),
                            state_url=rp.url, auth_cache_s=120.0, state_probe_s=1.0, state_timeout_s=1.0)
        start(cfg, local_cpus=4)
        http = http_client(cfg, timeout=120)
        try:
            _wait(lambda: http.get("/ready").status_code == 200, 120, "/ready", every=0.5)
            yield cfg, http, rp
        finally:
            http.close()
            stop(cfg)
    finally:
        rp.stop()


def _by_replica(http, path: str, want: int = 2, tries: int = 80) -> dict[str, object]:
    """One response per router replica (the Serve proxy picks one per request)."""
    seen = {}
    for _ in range(tries):
        r = http.get(path)
        seen[r.headers["x-kvnotes-replica"]] = r
        if len(seen) >= want:
            break
    assert len(seen) >= want, f"saw replicas {list(seen)}"
    return seen


@pytest.mark.slow
def test_redis_sigkilled_under_load_no_500_cached_keys_served_ready_follows(outage_cluster):
    from cluster.http.auth import create_key

    cfg, http, rp = outage_cluster
    state = open_state(cfg.state.resolved_url)
    fresh, _ = create_key(state, cfg.server.tenant)          # valid, but no replica has seen it yet
    state.close()
    fresh_hdr = {"authorization": f"Bearer {fresh}"}
    r = http.post("/v1/skills", json={"name": "refunds", "text": "Refunds take five business days."})
    assert r.status_code == 201, r.text
    rp.wait_written()

    def plain(i: int, headers=None):
        return http.post("/v1/completions", headers=headers, json={
            "model": cfg.workers.model, "prompt": f"Question {i}: what colour is the sky?", "max_tokens": 2, "temperature": 0})

    # both replicas validate the cluster's key once (it is then cached there)
    warmed = set()
    for i in range(40):
        r = plain(i)
        assert r.status_code == 200, r.text
        warmed.add(r.headers["x-kvnotes-replica"])
        if len(warmed) == 2:
            break
    assert len(warmed) == 2, warmed

    results: list[tuple[str, int, dict, str]] = []       # (kind, status, headers, body)
    stop, killed = threading.Event(), threading.Event()

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            kind = ("cached", "cached", "fresh", "notes")[(worker + i) % 4]
            if kind == "fresh" and not killed.is_set():
                kind = "cached"                    # the fresh key is first used during the outage
            if kind == "cached":
                r = plain(1000 * worker + i)
            elif kind == "fresh":
                r = plain(1000 * worker + i, fresh_hdr)
            else:                                  # needs a registration: other state than the key
                r = http.post("/v1/notes/completions", json={"segments": [{"skill": "refunds"}, {"text": "How long?"}],
                                                             "max_tokens": 2, "temperature": 0})
            results.append((kind, r.status_code, dict(r.headers), r.text))

    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(load, w) for w in range(4)]
        time.sleep(1.0)
        killed_at = len(results)
        rp.kill()
        killed.set()
        # every replica's probe (or a request) notices within a few seconds; from then on /ready
        # stays 503 on it and /health says degraded
        down = set()

        def all_down():
            r = http.get("/ready")
            if r.status_code == 503:
                assert r.json()["state_store"]["up"] is False, r.text
                down.add(r.headers["x-kvnotes-replica"])
            return len(down) == 2
        _wait(all_down, 15, "/ready to be 503 on both replicas", every=0.05)
        # the outage lasts until the load has shown what is asserted below (a cached-key request
        # served twice, a fresh-key and a notes request refused) and for at least 3 probe periods
        # (state_probe_s 1 s), at most 30 s; /ready and /health are sampled all along (it was a
        # fixed 10 s)
        outage_start = time.monotonic()
        ready_during = []

        def seen_enough() -> bool:
            during = results[killed_at:]
            refused = {k for k, s, _, _ in during if k != "cached" and s != 200}
            return (time.monotonic() - outage_start >= 3 * cfg.state.probe_s
                    and sum(1 for k, *_ in during if k == "cached") >= 2 and {"fresh", "notes"} <= refused)
        while not seen_enough() and time.monotonic() - outage_start < 30:
            ready_during.append(http.get("/ready").status_code)
            h = http.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
            time.sleep(0.2)
        during = results[killed_at:]
        rp.start()                                 # same port, same AOF
        restarted = time.monotonic()
        _wait(lambda: http.get("/ready").status_code == 200, 2.0, "/ready 200 within 2 s of the restart", every=0.05)
        ready_after = time.monotonic() - restarted
        stop.set()
        for f in futs:
            f.result(timeout=300)
    assert set(ready_during) == {503}, ready_during
    _wait(lambda: all(r.status_code == 200 for r in _by_replica(http, "/ready").values()), 10,
          "/ready 200 on both replicas", every=0.05)

    statuses = {(k, s) for k, s, _, _ in results}
    assert all(s != 500 for _, s, _, _ in results), [r for r in results if r[1] == 500][:3]
    # requests with a cached key that need no other state succeed throughout
    assert all(s == 200 for k, s, _, _ in results if k == "cached"), statuses
    assert sum(1 for k, _, _, _ in during if k == "cached") >= 2, statuses
    # the others are 503 state_store_unavailable with Retry-After while the store is down
    refused = [(k, s, h, b) for k, s, h, b in during if k != "cached" and s != 200]
    assert refused and {k for k, *_ in refused} == {"fresh", "notes"}, statuses
    for k, s, h, b in refused:
        err = json.loads(b)["error"]
        assert s == 503 and int(h["retry-after"]) >= 1, (k, s, b)
        assert err["code"] == "state_store_unavailable" and err["request_id"], b
    assert all(s in (200, 503) for _, s, _, _ in results), statuses
    # after the restart the fresh key and the registration work again, nothing was lost (AOF)
    assert plain(1, fresh_hdr).status_code == 200
    r = http.post("/v1/notes/completions", json={"segments": [{"skill": "refunds"}, {"text": "How long?"}],
                                                 "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    # every replica saw the outage: gauge back at 1, its probe failures and the skipped prompt
    # index lookups counted
    texts = [m.text for m in _by_replica(http, "/metrics").values()]
    assert all(metric(t, "kvnotes_state_store_up") == 1 for t in texts)
    assert all(metric(t, "kvnotes_state_store_errors_total", op="ping") >= 1 for t in texts)
    assert sum(metric(t, "kvnotes_fallbacks_total", reason="prompt_index_unavailable") for t in texts) >= 1
    from collections import Counter
    print(f"outage: {sorted(Counter((k, s) for k, s, _, _ in during).items())} during it; "
          f"/ready 200 {ready_after:.2f} s after the restart")
