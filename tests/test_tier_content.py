"""Content-addressed KV on the real LMCache tier with the real default model: a plan's KVRef is
all any worker needs (a fresh process finds a chunk through lm:// with no name map), a stored
prompt serves its piece-aligned prefixes, approximate KV is never read as exact, tenants never
share an entry, and a missing chunk is re-warmed."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kvruntime.messages.keys import tenant_salt
from kvruntime.messages.plan import KVRef
from kvruntime.ops import precompile_chunk, recompute
from kvruntime.config import TierConfig
from kvtransport.tier.lmcache_store import LMCacheStore
from kvtransport.tier.auth import tier_key
from kvtransport.tier.server import start_tier_server, stop_tier_server
from prefill_workers.tier_reads import PrefillTier

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]
SALT_A, SALT_B = tenant_salt("acme", b"s"), tenant_salt("globex", b"s")
TEXT = ("Refund policy: a passenger whose flight is delayed by more than three hours may ask for a refund of the "
        "unused ticket, or rebook on the next flight at no extra cost. ") * 6


@pytest.fixture
def tier(smol):
    store = LMCacheStore.for_engine(smol, TierConfig(cpu_bytes=200 << 20))
    yield PrefillTier(store, smol)
    store.close()


def test_a_prompt_serves_its_piece_aligned_prefixes(smol, tier):
    ids = tuple(smol.encode(TEXT * 2))[:600]
    kv = recompute(smol, list(ids), logits=False).kv
    tier.put(KVRef(ids, 0, SALT_A), kv)
    got = tier.get(KVRef(ids[:512], 0, SALT_A))                      # two 256-token pieces of the stored entry
    assert got is not None and torch.equal(got.data, kv.slice(0, 512).data)
    other = ids[:400] + tuple(range(1000, 1100))                      # same start, other continuation
    assert tier.contains([KVRef(ids, 0, SALT_A), KVRef(other, 0, SALT_A), KVRef(ids[:512], 0, SALT_B),
                          KVRef(ids[:512], 1, SALT_A)]) == [True, False, False, False]   # tenant, position: misses


def test_approximate_kv_is_never_read_as_exact(smol, tier):
    ids = tuple(smol.encode(TEXT))[:300]
    kv = recompute(smol, list(ids), logits=False).kv
    tier.put(KVRef(ids, 0, SALT_A, approx="ab" * 16), kv)
    assert tier.contains([KVRef(ids, 0, SALT_A), KVRef(ids, 0, SALT_A, approx="cd" * 16),
                          KVRef(ids, 0, SALT_A, approx="ab" * 16)]) == [False, False, True]


def test_precompile_is_idempotent_by_content_and_rewarm_compiles(smol, tier):
    ids = tuple(smol.encode(TEXT))[:120]
    ref = KVRef(ids, 1, SALT_A)
    first, again = tier.precompile(ref), tier.precompile(ref)
    assert not first.cached and first.bytes == 30 * 2 * 3 * 120 * 64 * 4 and again.cached and again.bytes == 0
    assert torch.equal(tier.get(ref).data, precompile_chunk(smol, list(ids)).data)
    assert not tier.precompile(KVRef(ids, 1, SALT_B)).cached            # tenant B computes its own
    assert tier.evict(ref) and tier.get(ref) is None
    tier.compile(ref)
    assert tier.get(ref) is not None
    with pytest.raises(ValueError, match="canonical position"):
        tier.compile(KVRef(ids, 5, SALT_A))
    # position 0 without a compile prefix: a stored context (a prompt's prefix, stored behind),
    # computed from position 0 with nothing before it
    ctx = KVRef(ids, 0, SALT_A)
    tier.compile(ctx)
    assert torch.equal(tier.get(ctx).data, precompile_chunk(smol, list(ids), []).data)
    with pytest.raises(ValueError, match="approximate"):
        tier.compile(KVRef(ids, 1, SALT_A, approx="ab" * 16))


_FRESH = """
    import json, sys, torch
    torch.set_num_threads(1)
    from kvruntime.engine import ReferenceEngine
    from kvruntime.messages.plan import KVRef
    from kvruntime.config import TierConfig
    from kvtransport.tier.lmcache_store import LMCacheStore
    from prefill_workers.tier_reads import PrefillTier
    job = json.load(open(sys.argv[1]))
    engine = ReferenceEngine("smollm2-135m", threads=1)
    store = LMCacheStore.for_engine(engine, TierConfig(cpu_bytes=100 << 20, remote_url=job["url"]),
                                         remote_key=bytes.fromhex(job["key"]))
    tier = PrefillTier(store, engine)
    ref = KVRef(tuple(job["ids"]), 1, job["salt"])
    kv = tier.get(ref)
    assert kv is not None and store.stats.hits_by_tier == {"remote": 1}, store.stats
    assert tier.precompile(ref).cached
    torch.save(kv.data, job["out"])
    store.close()
"""


def test_a_fresh_process_finds_a_chunk_from_its_ref_alone_through_lm(smol, tmp_path):
    key = tier_key(b"s" * 32)
    srv = start_tier_server("127.0.0.1", 0, key=key, log_path=tmp_path / "lmcache_server.log")
    store = LMCacheStore.for_engine(smol, TierConfig(cpu_bytes=100 << 20, remote_url=srv.url), remote_key=key)
    try:
        ids = tuple(smol.encode(TEXT))[:300]
        ref = KVRef(ids, 1, SALT_A)
        assert not PrefillTier(store, smol).precompile(ref).cached
        want = store.get(PrefillTier(store, smol).key(ref)).data
        job = {"url": srv.url, "key": key.hex(), "ids": list(ids), "salt": SALT_A, "out": str(tmp_path / "kv.pt")}
        (tmp_path / "job.json").write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH), str(tmp_path / "job.json")],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert torch.equal(torch.load(tmp_path / "kv.pt"), want)
    finally:
        store.close()
        stop_tier_server(srv)
