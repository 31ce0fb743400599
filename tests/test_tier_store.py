"""LMCacheStore on real LMCache 0.5.6 with synthetic KV of SmolLM2's shape (no model load):
tail pieces, tenants, partial hits, pin/evict, bad input, disk/fs tiers, and a remote
``lmcache_server`` that dies, hangs, is absent at start, and comes back."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.config import TierConfig
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.store import ChunkKey, TierWriteError, key_positions, tenant_salt
from kvtransport.tier.auth import tier_key
from kvtransport.tier.server import free_port, start_tier_server, stop_tier_server

# LMCache attaches an OpenTelemetry log handler when opentelemetry-sdk is installed (deprecated API).
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

L, H, D = 30, 3, 64              # SmolLM2-135M: layers, KV heads, head dim
MODEL, ROPE = "smollm2-135m", "5eed"
SMALL = dict(cpu_bytes=100 << 20)   # room for a few 1k-token fp32 chunks (46 MB each)
KEY = tier_key(os.urandom(32))   # the lm:// tier key of this test's "cluster secret"



def mkkey(n: int, tenant: str = "a", start: int = 100, position: int = 1) -> ChunkKey:
    return ChunkKey.build(MODEL, "float32", ROPE, range(start, start + n), tenant_salt(tenant), position)


def mkkv(key: ChunkKey, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(L, 2, H, key.num_tokens, D, generator=g), key_positions(key),
                   torch.tensor(key.token_ids))


def mkstore(**cfg) -> LMCacheStore:
    key = cfg.pop("remote_key", KEY if cfg.get("remote_url") else None)
    return LMCacheStore(MODEL, "float32", L, H, D, TierConfig(**{**SMALL, **cfg}), rope=ROPE, remote_key=key)


@pytest.fixture
def store():
    s = mkstore()
    yield s
    s.close()


@pytest.fixture
def server(tmp_path):
    srv = start_tier_server("127.0.0.1", 0, key=KEY, log_path=tmp_path / "lmcache_server.log")
    yield srv
    stop_tier_server(srv)


def test_300_and_1000_token_chunks_round_trip_exactly_tail_piece_included(store):
    for n in (300, 1000, 7):
        k = mkkey(n, start=n)
        kv = mkkv(k, seed=n)
        assert store.put(k, kv) == kv.nbytes
        assert store.contains(k)
        got = store.get(k)
        assert got is not None and torch.equal(got.data, kv.data)
        assert torch.equal(got.positions, torch.arange(1, n + 1)) and got.token_ids.tolist() == list(k.token_ids)
    s = store.stats
    assert (s.puts, s.gets, s.hits, s.lookup_hits) == (3, 3, 3, 3)
    assert s.hits_by_tier == {"cpu": 3} and s.misses == {}


def test_get_into_a_preallocated_tensor(store):
    k = mkkey(300)
    kv = mkkv(k)
    store.put(k, kv)
    out = torch.zeros_like(kv.data)
    got = store.get(k, out=out)
    assert got is not None and got.data.data_ptr() == out.data_ptr() and torch.equal(out, kv.data)
    with pytest.raises(ValueError, match="must be"):
        store.get(k, out=torch.zeros(L, 2, H, 299, D))


def test_piece_keys_do_not_depend_on_lmcache_process_globals(store):
    import lmcache.v1.token_database as tdb

    k = mkkey(600)
    before = [p[2].chunk_hash for p in store._pieces(k)]
    saved, tdb.NONE_HASH = tdb.NONE_HASH, 12345       # what vLLM's random per-process seed would do
    try:
        assert [p[2].chunk_hash for p in store._pieces(k)] == before
    finally:
        tdb.NONE_HASH = saved
    assert len(before) == 3 and [(s, e) for s, e, _ in store._pieces(k)] == [(0, 256), (256, 512), (512, 600)]
    tags = {p[2].tags for p in store._pieces(k)}
    assert tags == {(("kvn", k.namespace),)}


def test_tenant_b_misses_tenant_a_even_with_identical_tokens(store):
    ka, kb = mkkey(300, "a"), mkkey(300, "b")
    assert ka.token_ids == kb.token_ids
    store.put(ka, mkkv(ka))
    assert not store.contains(kb)
    assert store.get(kb) is None
    assert store.get(mkkey(300, "a", position=0)) is None   # another canonical position: another entry
    assert store.stats.misses == {"absent": 2} and store.stats.lookup_misses == {"absent": 1}


def test_a_partly_evicted_chunk_is_a_counted_miss(store):
    k = mkkey(1000)
    store.put(k, mkkv(k))
    cpu = store._engine.storage_manager.storage_backends["LocalCPUBackend"]
    last_piece = store._pieces(k)[-1][2]      # as if LMCache's LRU had dropped the tail piece
    assert cpu.remove(last_piece)
    assert not store.contains(k) and store.get(k) is None
    assert store.stats.misses == {"partial": 1} and store.stats.lookup_misses == {"partial": 1}


def test_a_chunk_no_tier_can_hold_is_an_error_and_lmcache_lru_drops_old_chunks():
    s = mkstore(cpu_bytes=31 << 20)                      # 31 MiB: less than one 1000-token chunk (44 MiB)
    try:
        big = mkkey(1000)
        with pytest.raises(TierWriteError, match="no tier holds the chunk"):
            s.put(big, mkkv(big))
        assert s.stats.put_tier_failures == {"cpu": 1} and s.stats.puts == 0
        first, second = mkkey(500, start=1), mkkey(500, start=2)   # 21.5 MiB each: the second evicts the first
        s.put(first, mkkv(first))
        s.put(second, mkkv(second))
        assert s.get(second) is not None and s.get(first) is None
        assert sum(s.stats.misses.values()) == 1
        assert s.pin(second)                            # a pinned chunk is never LMCache's victim
        with pytest.raises(TierWriteError):
            s.put(first, mkkv(first))
        assert s.get(second) is not None
    finally:
        s.close()


def test_pin_unpin_and_evict(store):
    k = mkkey(300)
    assert not store.pin(k)
    store.put(k, mkkv(k))
    assert store.pin(k) and store.unpin(k)
    assert store.evict(k)
    assert not store.contains(k) and not store.evict(k)
    assert store.stats.evictions == 1
    assert store.evict_many([k]) == 0 and store.contains_many([k]) == [False]


def test_occupancy_follows_puts_and_evictions(store):
    """kvnotes_tier_bytes{tier="cpu"} reads this: LMCache's hot cache in bytes, not a counter."""
    k1, k2 = mkkey(300), mkkey(600, start=5000)             # no shared prefix pieces
    base = store.occupancy().get("cpu", 0)
    store.put(k1, mkkv(k1))
    one = store.occupancy()["cpu"]
    assert one - base >= mkkv(k1).nbytes                   # whole 256-token pieces, tail included
    store.put(k2, mkkv(k2))
    two = store.occupancy()["cpu"]
    assert two - one >= mkkv(k2).nbytes
    assert store.evict(k2) and store.occupancy()["cpu"] == one
    assert store.evict(k1) and store.occupancy()["cpu"] == base


def test_put_and_get_reject_bad_input(store):
    k = mkkey(300)
    kv = mkkv(k)
    with pytest.raises(ValueError, match="does not match the store"):
        store.put(k, KVCache(kv.data.to(torch.bfloat16), kv.positions, kv.token_ids))
    with pytest.raises(ValueError, match="canonical positions"):
        store.put(k, KVCache(kv.data, kv.positions - 1, kv.token_ids))
    with pytest.raises(ValueError, match="slots"):
        store.put(mkkey(299), kv)
    with pytest.raises(ValueError, match="RoPE fingerprint"):
        store.get(ChunkKey.build(MODEL, "float32", "beef", k.token_ids, k.tenant, 1))
    with pytest.raises(ValueError, match="this store holds"):
        store.get(ChunkKey.build("gemma3-270m", "float32", ROPE, k.token_ids, k.tenant, 1))
    with pytest.raises(TypeError):
        store.get("refund-policy")
    with pytest.raises(ValueError, match="dtype"):
        LMCacheStore(MODEL, "int8", L, H, D)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        mkstore(connector="cuda")
    with pytest.raises(ValueError, match="tier_remote_url needs the tier key"):
        mkstore(remote_url="lm://127.0.0.1:1", remote_key=None)      # the key travels beside the config, never in it
    with pytest.raises(ValueError, match="32"):
        mkstore(remote_url="lm://127.0.0.1:1", remote_key=b"short")


def test_disk_tier_serves_chunks_when_local_cpu_is_off(tmp_path):
    s = mkstore(local_cpu=False, disk_path=str(tmp_path / "disk"), disk_bytes=31 << 20)  # room for 2 chunks
    try:
        k = mkkey(300)
        kv = mkkv(k)
        s.put(k, kv)
        got = s.get(k)
        assert got is not None and torch.equal(got.data, kv.data)
        assert s.tiers == ["disk"] and s.stats.hits_by_tier == {"disk": 1}
        for i in range(6):          # 6 x 13 MiB through a 31 MiB disk tier: evict() must free its space
            ki = mkkey(300, start=1000 * (i + 1))
            s.put(ki, mkkv(ki))
            assert s.evict(ki)
        assert s.stats.put_tier_failures == {}
    finally:
        s.close()


_FS_CHILD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from kvruntime.config import TierConfig
    from kvtransport.tier.lmcache_store import LMCacheStore
    from kvtransport.tier.store import ChunkKey, TierWriteError, key_positions, tenant_salt
    ids = list(range(100, 400))
    s = LMCacheStore("smollm2-135m", "float32", 30, 3, 64, TierConfig(cpu_bytes=100 << 20, persist_dir=sys.argv[1]))
    kv = s.get(ChunkKey.build("smollm2-135m", "float32", "5eed", ids, tenant_salt("a"), 1))
    assert kv is not None and s.stats.hits_by_tier == {"fs": 1}, s.stats
    torch.save(kv.data, sys.argv[2])
    s.close()
""")


def test_fs_tier_survives_a_process_restart(tmp_path):
    k = mkkey(300)
    kv = mkkv(k)
    s = mkstore(persist_dir=str(tmp_path / "fs"))
    s.put(k, kv)
    assert s.tiers == ["cpu", "fs"] and s.stats.put_tier_failures == {}
    s.close()
    out = tmp_path / "kv.pt"
    subprocess.run([sys.executable, "-c", _FS_CHILD, str(tmp_path / "fs"), str(out)], check=True, timeout=120)
    assert torch.equal(torch.load(out), kv.data)


def test_remote_server_killed_is_a_counted_miss_then_reconnects(server, tmp_path):
    """Operation-driven detection (no probe thread): the failed op marks it down."""
    writer = mkstore(remote_url=server.url, remote_probe_s=None)
    reader = mkstore(remote_url=server.url, remote_timeout_s=0.5, remote_retry_s=0.2, remote_probe_s=None)
    try:
        k = mkkey(300)
        kv = mkkv(k)
        writer.put(k, kv)
        assert writer.stats.put_tier_failures == {} and reader.stats.remote_up
        got = reader.get(k)                                   # reader's local tier is empty: remote hit
        assert got is not None and torch.equal(got.data, kv.data)
        assert reader.stats.hits_by_tier == {"remote": 1}

        os.kill(server.pid, signal.SIGKILL)                   # the server dies
        server.proc.wait(timeout=10)
        k2 = mkkey(1000, start=5000)
        t0 = time.monotonic()
        assert reader.get(k2) is None                         # a miss, not an exception
        assert reader.contains(k2) is False
        assert time.monotonic() - t0 < 3
        s = reader.stats
        assert s.misses == {"remote_down": 1} and s.remote_down_misses == 2
        assert not s.remote_up and s.remote_errors >= 1
        reader.put(k2, mkkv(k2))                              # the local tier still takes it
        assert reader.stats.put_tier_failures == {"remote": 1}
        assert reader.get(k2) is not None

        again = start_tier_server("127.0.0.1", server.port, key=KEY, log_path=tmp_path / "again.log")
        try:
            time.sleep(0.3)                                   # past remote_retry_s
            assert reader.get(mkkey(300, start=9000)) is None  # re-attaches, then a plain miss
            assert reader.stats.remote_up and reader.stats.remote_reconnects == 1
            assert reader.stats.misses == {"remote_down": 1, "absent": 1}
            reader.put(k, kv)                                 # the restarted server is empty: it takes k
            assert reader.stats.put_tier_failures == {"remote": 1}   # still only the put made while down
        finally:
            stop_tier_server(again)
    finally:
        writer.close()
        reader.close()


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Block until the kernel reports ``pid`` stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not stop within {timeout_s}s of SIGSTOP")


def test_hung_remote_server_costs_one_timeout_not_a_hang(server):
    s = mkstore(remote_url=server.url, remote_timeout_s=0.5, remote_retry_s=60, remote_probe_s=None)
    try:
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)        # kill() only queues the signal: on a busy box it can still answer
        t0 = time.monotonic()
        assert s.get(mkkey(300)) is None
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert s.get(mkkey(300)) is None                      # bypassed while down: instant
        assert first < 2.5 and time.monotonic() - t0 < 0.5
        assert s.stats.misses == {"remote_down": 2} and not s.stats.remote_up
    finally:
        os.kill(server.pid, signal.SIGCONT)
        s.close()


def test_remote_absent_at_start_is_a_miss_not_an_error():
    t0 = time.monotonic()
    s = mkstore(remote_url=f"lm://127.0.0.1:{free_port()}", remote_timeout_s=0.5)
    try:
        k = mkkey(300)
        assert s.get(k) is None and s.stats.misses == {"remote_down": 1}
        s.put(k, mkkv(k))
        assert s.stats.put_tier_failures == {"remote": 1} and s.get(k) is not None
        assert time.monotonic() - t0 < 10
    finally:
        s.close()


def test_a_server_outlives_neither_its_stop_nor_its_starter():
    code = ("from kvtransport.tier.server import start_tier_server as s; import os; "
            "print(s(key=os.urandom(32)).pid, flush=True); os._exit(0)")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True).stdout.split()[-1])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    if os.path.exists(f"/proc/{pid}"):
        stop_tier_server(pid)
        pytest.fail("the server outlived the process that started it")
