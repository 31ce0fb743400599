"""The config split by concern: typed frozen sections, today's flat keys and the nested form load
the same value, unknown keys and bad values are ValueError naming the key, and the per-role
device settings resolve as documented."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import yaml

from kvruntime.config import FLAT_KEYS, SECTIONS, ClusterConfig, WorkerConfig


def test_every_section_field_has_exactly_one_flat_key():
    fields = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(FLAT_KEYS.values()) == fields and len(FLAT_KEYS) == len(fields)
    assert FLAT_KEYS["tier_cpu_bytes"] == ("tier", "cpu_bytes") and FLAT_KEYS["port"] == ("server", "port")
    assert FLAT_KEYS["kv_transport"] == ("transport", "kind") and FLAT_KEYS["prefill"] == ("workers", "prefill")


def test_flat_and_nested_forms_load_the_same_value(tmp_path):
    flat = {"port": 8123, "tier_cpu_bytes": 1 << 28, "kv_transport": "grpc", "kv_grpc": {"inbox_bytes": 1 << 20},
            "state_url": "sqlite:///x.db", "shadow_fraction": 0.5, "prefill": {"count": 2, "threads": 2},
            "decode_engine": "reference", "ray_start_attempts": 3, "health_period_s": 2.0, "default_policy": "fast"}
    nested = {"server": {"port": 8123}, "tier": {"cpu_bytes": 1 << 28},
              "transport": {"kind": "grpc", "grpc": {"inbox_bytes": 1 << 20}}, "state": {"url": "sqlite:///x.db"},
              "shadow": {"fraction": 0.5}, "workers": {"prefill": {"count": 2, "threads": 2}, "decode_engine": "reference"},
              "ray": {"start_attempts": 3}, "routing": {"health_period_s": 2.0}, "policy": {"default_policy": "fast"}}
    p = tmp_path / "flat.yaml"
    p.write_text(yaml.safe_dump(flat))
    a = ClusterConfig.from_file(p)
    assert a == ClusterConfig.from_dict(nested) == ClusterConfig.of(**flat)
    assert (a.server.port, a.tier.cpu_bytes, a.transport.kind, a.transport.options("grpc")) == \
        (8123, 1 << 28, "grpc", {"inbox_bytes": 1 << 20})
    assert (a.workers.prefill.count, a.workers.decode.count, a.state.url, a.ray.start_attempts) == \
        (2, 1, "sqlite:///x.db", 3)
    assert hash(a) == hash(ClusterConfig.from_dict(nested)) and pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.server.port = 1                                            # type: ignore[misc]


def test_unknown_keys_and_double_settings_are_named():
    with pytest.raises(ValueError, match="unknown config key.*tier_cpu_byte"):
        ClusterConfig.from_dict({"tier_cpu_byte": 1})
    with pytest.raises(ValueError, match="unknown config key.*in tier: tier_cpu_bytes"):
        ClusterConfig.from_dict({"tier": {"tier_cpu_bytes": 1}})      # nested form: the section's own names
    with pytest.raises(ValueError, match="server.port.*already set by port"):
        ClusterConfig.from_dict({"port": 1, "server": {"port": 2}})
    with pytest.raises(ValueError, match="tier must be a mapping"):
        ClusterConfig.from_dict({"tier": 5})
    with pytest.raises(ValueError, match="prefill must be a mapping"):
        ClusterConfig.from_dict({"prefill": {"gpus": 1}})
    with pytest.raises(ValueError, match="port must be in"):
        ClusterConfig.from_dict({"port": 0})
    with pytest.raises(ValueError, match="server must be a ServerConfig"):
        ClusterConfig(server={"port": 1})                            # type: ignore[arg-type]


def test_replace_keeps_the_rest_and_old_attribute_names_say_where_they_went():
    c = ClusterConfig.of(port=9000, tier_cpu_bytes=1 << 27)
    d = c.replace(bind_host="127.0.0.1", prefill=WorkerConfig(count=3))
    assert (d.server.port, d.server.bind_host, d.tier.cpu_bytes, d.workers.prefill.count) == \
        (9000, "127.0.0.1", 1 << 27, 3)
    assert c.server.bind_host is None                                # the original is unchanged
    with pytest.raises(AttributeError, match=r"config\.tier\.cpu_bytes"):
        c.tier_cpu_bytes                                             # noqa: B018
    assert "state_url" not in repr(ClusterConfig.of(state_url="redis://:secret@h:1/0"))
    assert "secret" not in repr(ClusterConfig.of(state_url="redis://:secret@h:1/0"))


def test_device_per_role_is_validated_and_resolved():
    assert ClusterConfig.of(prefill={"device": "cuda", "num_gpus": 1}).workers.prefill.device == "cuda"
    assert ClusterConfig.of(decode={"num_gpus": 0.5}).workers.decode.num_gpus == 0.5
    for bad, msg in (({"device": "tpu"}, "device must be one of auto, cpu, cuda, got .tpu."),
                     ({"device": "cuda"}, "cuda needs decode.num_gpus > 0"),
                     ({"device": "cpu", "num_gpus": 1}, "reserves a GPU"),
                     ({"num_gpus": -1}, "num_gpus")):
        with pytest.raises(ValueError, match=msg):
            ClusterConfig.of(decode=bad)
    # resolved in the actor (kvruntime.device): what torch sees and what Ray assigned
    from kvruntime.device import DeviceUnavailable, resolve_device

    def on(device, *, cuda, ids):
        return resolve_device(device, "prefill", cuda=lambda: cuda, gpu_ids=lambda: ids)
    assert on("auto", cuda=True, ids=[0]) == "cuda"
    assert on("auto", cuda=True, ids=[]) == "cpu"        # Ray gave this actor no GPU
    assert on("auto", cuda=False, ids=[0]) == "cpu"      # torch sees none
    assert on("cpu", cuda=True, ids=[0]) == "cpu"
    assert on("cuda", cuda=True, ids=["0"]) == "cuda"
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        on("cuda", cuda=False, ids=[])


def test_enumerated_settings_become_members_once_and_bad_values_name_the_key():
    from kvruntime.config.choices import (DecodeEngineKind, KVLoadMode, LoadFailurePolicy, ShadowMetric, TierConnector,
                                          TransportKind)
    c = ClusterConfig.of(kv_transport="grpc", kv_load_failure_policy="fail", decode_engine="vllm", vllm_kv_load="sync",
                         shadow_metric="greedy_exact", tier_connector="cuda")
    assert c.transport.kind is TransportKind.GRPC and c.transport.kv_load_failure_policy is LoadFailurePolicy.FAIL
    assert c.workers.decode_engine is DecodeEngineKind.VLLM and c.workers.vllm_kv_load is KVLoadMode.SYNC
    assert c.shadow.metric is ShadowMetric.GREEDY_EXACT and c.tier.connector is TierConnector.CUDA
    # members are their strings on the wire, in logs and in metric labels
    assert f"{c.transport.kind}" == "grpc" and c.transport.kind == "grpc"
    assert pickle.loads(pickle.dumps(c)) == c and pickle.loads(pickle.dumps(c)).transport.kind is TransportKind.GRPC
    for key, bad, msg in (("kv_transport", "rdma", "kv_transport must be one of auto, nixl, grpc, got 'rdma'"),
                          ("kv_load_failure_policy", "retry", "kv_load_failure_policy must be one of recompute, fail"),
                          ("decode_engine", "sglang", "decode_engine must be one of reference, vllm"),
                          ("vllm_kv_load", "later", "vllm_kv_load must be one of async, sync"),
                          ("shadow_metric", "cosine", "shadow_metric must be one of top1, greedy_exact"),
                          ("tier_connector", "tpu", "tier_connector must be one of cpu, cuda")):
        with pytest.raises(ValueError, match=msg):
            ClusterConfig.of(**{key: bad})
    # a component built directly (tests, benches) goes through the same single check
    from kvtransport.transfer.endpoints import Sender
    with pytest.raises(ValueError, match="kv_transport must be one of auto, nixl, grpc, got 'rdma'"):
        Sender("rdma")


def test_one_tier_and_shadow_section_in_bytes_with_the_tier_flat_keys():
    c = ClusterConfig.of(tier_cpu_bytes=64 << 20, tier_disk_path="/tmp/kvn-disk", tier_disk_bytes=2 << 30,
                         tier_chunk_size=128, tier_local_cpu=False, shadow_opt_out_tenants={"b", "a"})
    assert (c.tier.cpu_bytes, c.tier.disk_bytes, c.tier.chunk_size, c.tier.local_cpu) == (64 << 20, 2 << 30, 128, False)
    assert c.shadow.opt_out_tenants == ("a", "b")
    with pytest.raises(ValueError, match="tier_cpu_bytes must be an integer"):
        ClusterConfig.of(tier_cpu_bytes=0.5)                 # GiB is not a unit here: bytes
    with pytest.raises(ValueError, match="no tier would hold anything"):
        ClusterConfig.of(tier_local_cpu=False)
    with pytest.raises(ValueError, match="shadow_opt_out_tenants must be a list"):
        ClusterConfig.of(shadow_opt_out_tenants="private")


def test_serve_refuses_a_tier_piece_size_the_prompt_index_does_not_use():
    from cluster.control.prompt_index import PROMPT_BLOCK
    from cluster.operator.launcher import check_prompt_block
    check_prompt_block(ClusterConfig())                            # the default: the tier's pieces are the index's block
    assert ClusterConfig().tier.chunk_size == PROMPT_BLOCK
    with pytest.raises(ValueError, match=f"tier_chunk_size 128 is not supported.*every {PROMPT_BLOCK} tokens"):
        check_prompt_block(ClusterConfig.of(tier_chunk_size=128))


def test_the_vllm_kv_space_is_in_bytes_and_the_old_gib_key_says_what_replaced_it():
    assert ClusterConfig.of(vllm_kv_cache_bytes=2 << 30).workers.vllm_kv_cache_bytes == 2 << 30
    with pytest.raises(ValueError, match="vllm_kv_cache_bytes must be an integer"):
        ClusterConfig.of(vllm_kv_cache_bytes=1.5)
    with pytest.raises(ValueError, match="unknown config key.*vllm_kv_cache_gib is now vllm_kv_cache_bytes"):
        ClusterConfig.of(vllm_kv_cache_gib=4)


def test_the_policy_names_are_one_list():
    from kvruntime.config.policy import POLICIES
    from kvruntime.messages.plan import Policy
    assert POLICIES == tuple(p.value for p in Policy)        # the config (below messages) and the wire agree
    with pytest.raises(ValueError, match="default_policy must be one of exact, balanced, fast, got 'quick'"):
        ClusterConfig.of(default_policy="quick")


def test_the_matching_section_flat_or_nested_reaches_the_router_and_bad_values_name_the_key(tmp_path):
    from kvruntime.config import MatchConfig, SpanConfig
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({"matching": {"min_chunk_tokens": 64, "compile_after": 3, "spans": {"anchor_bits": 6},
                                              "fingerprint_max": 5000, "held_prompt_ttl_s": 60.0}}))
    a = ClusterConfig.from_file(p)
    assert a.matching == ClusterConfig.of(matching_min_chunk_tokens=64, matching_compile_after=3,
                                          matching_spans={"anchor_bits": 6}, matching_fingerprint_max=5000,
                                          matching_held_prompt_ttl_s=60.0).matching
    assert a.matching.spans == SpanConfig(anchor_bits=6) and a.matching.enabled and hash(a) == hash(a.replace())
    assert a.matching.store_limits()["fingerprint_max"] == 5000 and ClusterConfig().matching == MatchConfig()
    from cluster.control.matching import MatchConfig as Matcher
    from cluster.control.state import StoreLimits
    assert Matcher is MatchConfig and StoreLimits(**a.state.store_limits(), **a.matching.store_limits()).held_prompt_ttl_s == 60
    for bad, key in [({"matching_compile_after": 0}, "matching.compile_after"),
                     ({"matching": {"spans": {"windw": 8}}}, "matching.spans: windw"),
                     ({"matching_spans": {"window": 1}}, "matching.spans.window"),
                     ({"matching_enabled": "yes"}, "matching.enabled"),
                     ({"matching_min_chunk_tokens": 2.5}, "matching.min_chunk_tokens"),
                     ({"matching_edit_min_share": 0}, "matching.edit_min_share"),
                     ({"matching_fingerprint_ttl_s": 0}, "matching.fingerprint_ttl_s"),
                     ({"matching": {"held_prompts": 3}}, "unknown config key(s) in matching: held_prompts")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
            ClusterConfig.from_dict(bad)
