"""Keys of the KV tier: what changes a ChunkKey, what does not, and bad input (no model, no LMCache)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvruntime.kv import KVCache
from kvruntime.rope import RopeTable
from kvtransport.tier.store import (ChunkKey, check_kv, check_model_id, prefix_hash, rope_fingerprint, tenant_salt,
                               token_hash)

IDS = list(range(100, 400))
SALT_A = tenant_salt("tenant-a")


def key(**over) -> ChunkKey:
    args = dict(model_id="smollm2-135m", dtype="float32", rope="ab12", token_ids=IDS, tenant=SALT_A, position=1)
    args.update(over)
    return ChunkKey.build(**args)


def test_same_inputs_same_key_and_digest():
    assert key() == key()
    assert hash(key()) == hash(key())
    assert key().digest == key().digest
    assert len(key().digest) == 32


@pytest.mark.parametrize("change", [
    dict(model_id="gemma3-270m"), dict(dtype="bfloat16"), dict(rope="ab13"),
    dict(token_ids=IDS[:-1]), dict(token_ids=IDS[:-1] + [IDS[-1] + 1]), dict(token_ids=IDS[::-1]),
    dict(tenant=tenant_salt("tenant-b")), dict(position=0), dict(approx="ab" * 16),
    dict(prefix=prefix_hash([1, 9690, 198])), dict(prefix=prefix_hash([])),
])
def test_every_identifying_field_changes_the_key(change):
    k = key(**change)
    assert k != key()
    assert k.digest != key().digest


def test_tenant_salt_is_deterministic_secret_keyed_and_hides_the_name():
    assert tenant_salt("a") == tenant_salt("a")
    assert tenant_salt("a") != tenant_salt("b")
    assert tenant_salt("a", secret=b"s1") != tenant_salt("a", secret=b"s2")
    assert "tenant-a" not in repr(key())


def test_token_ids_ride_along_but_the_hash_commits_to_them():
    k = key()
    assert k.token_ids == tuple(IDS) and k.num_tokens == 300
    assert k.token_hash == token_hash(IDS)
    assert k.positions == range(1, 301)


def test_rope_fingerprint_tracks_frequencies_and_head_dim():
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    base = RopeTable(inv.repeat(30, 1), 64)
    assert rope_fingerprint(base) == rope_fingerprint(RopeTable(inv.repeat(30, 1), 64))
    assert rope_fingerprint(base) != rope_fingerprint(RopeTable((inv * 1.0001).repeat(30, 1), 64))
    assert rope_fingerprint(base) != rope_fingerprint(RopeTable(inv.repeat(29, 1), 64))
    assert rope_fingerprint(base) != rope_fingerprint(RopeTable(inv.repeat(30, 1), 128))


@pytest.mark.parametrize("bad, match", [
    (dict(token_ids=[]), "empty chunk"),
    (dict(token_ids=[1, -2]), ">= 0"),
    (dict(position=-1), "position"),
    (dict(dtype="int8"), "dtype"),
    (dict(model_id="a@b"), "model_id"),
    (dict(model_id=""), "model_id"),
    (dict(model_id="x" * 65), "model_id"),
    (dict(rope="XYZ"), "rope"),
    (dict(tenant="tenant-a"), "tenant"),
    (dict(prefix="ab12"), "prefix"),
])
def test_bad_key_input_is_a_valueerror_with_a_message(bad, match):
    with pytest.raises(ValueError, match=match):
        key(**bad)


def test_direct_construction_is_validated_too():
    k = key()
    with pytest.raises(ValueError, match="token_ids has 299 ids"):
        dataclasses.replace(k, token_ids=k.token_ids[:-1])
    with pytest.raises(ValueError, match="num_tokens"):
        dataclasses.replace(k, num_tokens=0, token_ids=())
    with pytest.raises(ValueError):
        tenant_salt("")
    assert check_model_id("smollm2-135m") == "smollm2-135m"


def test_check_kv_wants_the_chunk_at_canonical_positions():
    k = key(token_ids=[5, 6, 7])
    data = torch.zeros(2, 2, 1, 3, 4)
    check_kv(k, KVCache(data, torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])))
    with pytest.raises(ValueError, match="canonical positions"):
        check_kv(k, KVCache(data, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])))
    with pytest.raises(ValueError, match="token ids"):
        check_kv(k, KVCache(data, torch.tensor([1, 2, 3]), torch.tensor([5, 6, 8])))
    with pytest.raises(ValueError, match="slots"):
        check_kv(k, KVCache(data[:, :, :, :2], torch.tensor([1, 2]), torch.tensor([5, 6])))


def test_tier_config_and_remote_url_validation():
    from kvruntime.config import TierConfig
    from kvruntime.config.choices import TierConnector
    from kvtransport.tier.lmcache_remote import parse_lm_url

    assert parse_lm_url("lm://127.0.0.1:65432") == ("127.0.0.1", 65432)
    for url in ["redis://x:1", "lm://host", "lm://:1", "lm://h:0", "lm://h:99999", "lm://h:p"]:
        with pytest.raises(ValueError, match="lm://host:port"):
            parse_lm_url(url)
    with pytest.raises(ValueError, match="lm://host:port"):
        TierConfig(remote_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="tier_disk_bytes"):
        TierConfig(disk_path="/tmp/x", disk_bytes=0)
    with pytest.raises(ValueError, match="tier_cpu_bytes"):
        TierConfig(cpu_bytes=0)
    with pytest.raises(ValueError, match="tier_cpu_bytes must be an integer"):
        TierConfig(cpu_bytes=0.5)                     # bytes, not GiB
    with pytest.raises(ValueError, match="no tier"):
        TierConfig(local_cpu=False)
    with pytest.raises(ValueError, match="tier_connector must be one of cpu, cuda"):
        TierConfig(connector="tpu")
    with pytest.raises(ValueError, match="chunk_size"):
        TierConfig(chunk_size=100)
    assert TierConfig(connector="cuda").connector is TierConnector.CUDA


def test_prefix_hash_distinguishes_the_anchor_the_empty_prefix_and_frames():
    assert prefix_hash(None) == ""                       # the default anchor: BOS-compiled keys unchanged
    assert key(prefix=prefix_hash(None)) == key()
    frames = [prefix_hash(p) for p in ([], [1], [1, 2], [2, 1])]
    assert len(set(frames)) == 4 and "" not in frames
    a, b = key(prefix=frames[2]), key(prefix=frames[3])
    assert a != b and a.namespace != b.namespace and a.namespace != key().namespace
