"""Precompiled skills and memories with the real default model (SmolLM2-135M) on LMCache:
retrieval in a fresh process through ``lmcache_server``, a dead remote, tenants, capacity,
and a process restart with the ``fs://`` tier."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import pytest
import torch

from kvruntime.ops import precompile_chunk
from kvtransport.lmcache_store import LMCacheStore, TierConfig
from kvtransport.store import ChunkKey
from kvtransport.tier_server import start_tier_server, stop_tier_server
from prefill_workers.precompile import CapacityError, Precompiler, UnknownChunkError

# LMCache attaches an OpenTelemetry log handler when opentelemetry-sdk is installed (deprecated API).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

POLICY = ("Refund policy {i}: a passenger whose flight is delayed by more than {h} hours may ask "
          "for a refund of the unused ticket, or rebook on the next flight at no extra cost. ")



def text_of(engine, n: int, salt: str = "") -> str:
    """English text that tokenizes to exactly ``n`` tokens."""
    text, i = salt, 0
    while len(engine.encode(text)) < n - 40:
        text += POLICY.format(i=i, h=2 + i % 5)
        i += 1
    words = text.split(" ")
    while len(engine.encode(" ".join(words))) > n:
        words.pop()
    text = " ".join(words)
    while len(engine.encode(text)) < n:
        text += " ok"
    assert len(engine.encode(text)) == n
    return text


def run_child(code: str, *args: str, timeout: int = 180) -> None:
    """Run ``code`` in a fresh Python process; fail the test with its output if it fails."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def key_json(key: ChunkKey) -> dict:
    return {**asdict(key), "token_ids": list(key.token_ids)}


@pytest.fixture
def server(tmp_path):
    srv = start_tier_server("127.0.0.1", 0, log_path=tmp_path / "lmcache_server.log")
    yield srv
    stop_tier_server(srv)


_REMOTE_READER = """
    import json, sys, torch
    torch.set_num_threads(1)
    from kvtransport.lmcache_store import LMCacheStore, TierConfig
    from kvtransport.store import ChunkKey
    job = json.load(open(sys.argv[1]))
    keys = [ChunkKey(**{**k, "token_ids": tuple(k["token_ids"])}) for k in job["keys"]]
    store = LMCacheStore(job["model"], job["dtype"], *job["shape"], TierConfig(local_cpu_gb=0.2, remote_url=job["url"]),
                         rope=job["rope"])
    kvs = [store.get(k) for k in keys]
    assert all(kv is not None for kv in kvs), store.stats
    assert store.stats.hits_by_tier == {"remote": len(keys)}, store.stats
    torch.save([(kv.data, kv.positions, kv.token_ids) for kv in kvs], job["out"])
    store.close()
"""


def test_300_and_1000_token_skills_come_back_exactly_in_a_fresh_process_via_lmcache_server(smol, server, tmp_path):
    store = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.2, remote_url=server.url))
    pre = Precompiler(smol, store)
    try:
        results = [pre.precompile(f"skill-{n}", text_of(smol, n)) for n in (300, 1000)]
        for r, n in zip(results, (300, 1000)):
            assert r.created and r.num_tokens == n and r.seconds > 0 and r.evicted == ()
            assert r.nbytes == 30 * 2 * 3 * n * 64 * 4
        stored = [pre.get(r.name).data for r in results]           # the bytes the tier holds
        for r, data in zip(results, stored):                       # == a fresh prefill of the same tokens
            assert torch.equal(data, precompile_chunk(smol, list(r.key.token_ids)).data)
        assert store.stats.put_tier_failures == {}                 # the remote confirmed both chunks

        job = {"keys": [key_json(r.key) for r in results], "model": store.model_id, "dtype": store.dtype,
               "shape": list(store.shape), "rope": store.rope, "url": server.url, "out": str(tmp_path / "kv.pt")}
        (tmp_path / "job.json").write_text(json.dumps(job))
        run_child(_REMOTE_READER, str(tmp_path / "job.json"))
        for (data, positions, ids), want, r in zip(torch.load(tmp_path / "kv.pt"), stored, results):
            assert torch.equal(data, want)
            assert torch.equal(positions, torch.arange(1, r.num_tokens + 1))
            assert ids.tolist() == list(r.key.token_ids)

        again = pre.precompile("skill-300", text_of(smol, 300))   # idempotent: no prefill
        assert not again.created and again.key == results[0].key
    finally:
        store.close()


def test_remote_down_is_a_counted_miss_and_the_caller_recomputes(smol, server, tmp_path):
    reg = tmp_path / "registry.json"
    writer = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.1, remote_url=server.url))
    reader = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.1, remote_url=server.url, remote_timeout_s=0.5))
    try:
        r = Precompiler(smol, writer, registry_path=reg).precompile("refund-policy", text_of(smol, 300))
        want = writer.get(r.key).data
        pre = Precompiler(smol, reader, registry_path=reg)         # another actor: same names, empty local tier
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        t0 = time.monotonic()
        got = pre.load("refund-policy")                            # no exception, no hang
        assert got.source == "recomputed" and time.monotonic() - t0 < 60
        assert torch.equal(got.kv.data, want)
        assert reader.stats.misses == {"remote_down": 1} and reader.stats.remote_down_misses == 1
        assert pre.recomputes == 1 and not reader.stats.remote_up and reader.stats.remote_errors >= 1
        assert reader.stats.put_tier_failures == {"remote": 1}    # stored back locally only
        assert pre.load("refund-policy").source == "tier"
    finally:
        writer.close()
        reader.close()


def test_tenant_b_cannot_hit_tenant_a_skill_with_identical_text(smol):
    store = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.1))
    pre = Precompiler(smol, store)
    try:
        text = text_of(smol, 120)
        a = pre.precompile("policy", text, tenant="acme")
        with pytest.raises(UnknownChunkError, match="tenant 'globex'"):
            pre.get("policy", tenant="globex")
        b = pre.precompile("policy", text, tenant="globex")
        assert a.created and b.created                            # B computed its own: no hit on A's entry
        assert a.key.token_ids == b.key.token_ids and a.key != b.key and a.key.digest != b.key.digest
        assert store.stats.lookup_misses == {"absent": 2} and store.stats.lookup_hits == 0
        assert not pre.precompile("policy", text, tenant="acme").created
        assert pre.delete("policy", tenant="acme")
        assert not store.contains(a.key) and store.contains(b.key)
        assert [e.tenant for e in pre.list()] == ["globex"]
    finally:
        store.close()


def test_capacity_evicts_lru_names_visibly_and_bad_input_is_a_valueerror(smol):
    store = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.1))
    per = 30 * 2 * 3 * 40 * 64 * 4                               # KV bytes of a 40-token chunk
    pre = Precompiler(smol, store, max_bytes=2 * per)
    try:
        texts = {n: text_of(smol, 40, salt=f"{n}: ") for n in "abc"}
        pre.precompile("a", texts["a"])
        pre.precompile("b", texts["b"], kind="memory")
        assert pre.get("a") is not None                           # a is now more recent than b
        c = pre.precompile("c", texts["c"])
        assert c.evicted == ("default/memory/b",)
        assert [e.label for e in pre.evictions] == ["default/memory/b"]
        assert [e.name for e in pre.list()] == ["a", "c"] and pre.used_bytes == 2 * per
        assert [e.name for e in pre.list(kind="memory")] == []
        assert pre.delete("a") and not pre.delete("a")
        with pytest.raises(UnknownChunkError):
            pre.load("b", kind="memory")

        pre.pin("c")
        pre.precompile("d", texts["a"])
        pre.pin("d")
        with pytest.raises(CapacityError, match="pinned"):
            pre.precompile("e", texts["b"])
        pre.unpin("d")
        assert pre.precompile("e", texts["b"]).evicted == ("default/skill/d",)

        for call, match in [
            (lambda: pre.precompile("x", ""), "non-empty"),
            (lambda: pre.precompile("x", None), "non-empty"),
            (lambda: pre.precompile("x", "hi", kind="tool"), "kind"),
            (lambda: pre.precompile("bad name", "hi"), "name"),
            (lambda: pre.precompile("x", "hi", tenant=""), "tenant"),
            (lambda: pre.precompile("x", text_of(smol, 200)), "over the limit"),
            (lambda: pre.precompile("x", " word" * 9000), "tokens; must be"),
            (lambda: Precompiler(smol, store, max_entries=0), "max_bytes and max_entries"),
        ]:
            with pytest.raises(ValueError, match=match):
                call()
    finally:
        store.close()


_RESTARTED = """
    import json, sys, torch
    from kvruntime.engine import ReferenceEngine
    from kvtransport.lmcache_store import LMCacheStore, TierConfig
    from prefill_workers.precompile import Precompiler
    job = json.load(open(sys.argv[1]))
    engine = ReferenceEngine("smollm2-135m", threads=1)
    store = LMCacheStore.for_engine(engine, TierConfig(local_cpu_gb=0.1, persist_dir=job["persist"]))
    pre = Precompiler(engine, store)
    names = [(e.tenant, e.kind, e.name) for e in pre.list()]
    assert names == [tuple(x) for x in job["names"]], names
    out = {}
    for tenant, kind, name in names:
        res = pre.load(name, kind=kind, tenant=tenant)
        assert res.source == "tier", (name, store.stats)
        out[name] = res.kv.data
    assert store.stats.hits_by_tier == {"fs": len(names)} and pre.recomputes == 0, store.stats
    again = pre.precompile("skill-300", job["text"])
    assert not again.created, "the restarted process prefilled again"
    torch.save(out, job["out"])
    store.close()
"""


def test_a_restarted_process_finds_precompiled_skills_in_the_fs_tier(smol, tmp_path):
    persist = tmp_path / "tier"
    store = LMCacheStore.for_engine(smol, TierConfig(local_cpu_gb=0.1, persist_dir=str(persist)))
    pre = Precompiler(smol, store)
    text = text_of(smol, 300)
    pre.precompile("skill-300", text)
    pre.precompile("user-42", "The user prefers aisle seats and flies with a service dog.", kind="memory",
                   tenant="acme")
    want = {e.name: store.get(e.key).data for e in pre.list()}
    names = [list(e.ident) for e in pre.list()]
    pre.close()
    store.close()                                                 # the "old process" is gone
    assert (persist / "kvnotes-registry-smollm2-135m.json").exists()

    job = {"persist": str(persist), "names": names, "text": text, "out": str(tmp_path / "kv.pt")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    run_child(_RESTARTED, str(tmp_path / "job.json"))
    got = torch.load(tmp_path / "kv.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
