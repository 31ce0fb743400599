"""The vLLM decode engine's settings and hand-offs, without starting vLLM: the version pin is
checked with one clear error, the connector's extra config is validated key by key, and the
actor's inbox reaches the connector by key or not at all."""
from __future__ import annotations

import re
import pathlib

import pytest

from decode_workers.vllm_adapter import PINNED_VLLM, VllmVersionError, check_version
from decode_workers.vllm_inbox import InboxRegistry
from decode_workers.vllm_settings import ConnectorSettings, VllmEngineConfig, load_params
from kvruntime.config import ClusterConfig
from kvruntime.config.choices import KVLoadMode, LoadFailurePolicy
from kvtransport.transfer.interface import KVReceiver

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_another_vllm_version_is_one_error_naming_both():
    with pytest.raises(VllmVersionError) as e:
        check_version("0.31.2")
    assert PINNED_VLLM in str(e.value) and "0.31.2" in str(e.value)
    assert check_version(f"{PINNED_VLLM}+cpu") == f"{PINNED_VLLM}+cpu"      # a local build tag is the same release


def test_the_pin_is_pyprojects():
    text = (ROOT / "pyproject.toml").read_text()
    pins = set(re.findall(r'"vllm(?:-cpu)?==([0-9.]+)"', text))
    assert pins == {PINNED_VLLM}, pins


def test_engine_config_checks_each_value_once():
    c = VllmEngineConfig("smollm2-135m", load_failure_policy="fail", kv_load="sync")
    assert c.load_failure_policy is LoadFailurePolicy.FAIL and c.kv_load is KVLoadMode.SYNC
    for bad in ({"kv_load": "later"}, {"load_failure_policy": "ignore"}, {"threads": 0}, {"device": "tpu"},
                {"grpc_port": 70000}, {"kv_cache_gib": 0}):
        with pytest.raises(ValueError):
            VllmEngineConfig("smollm2-135m", **bad)


def test_engine_config_from_the_cluster_config():
    cfg = ClusterConfig.of(decode_engine="vllm", vllm_kv_load="sync", vllm_kv_load_threads=3, vllm_max_model_len=2048,
                           kv_load_failure_policy="fail")
    c = VllmEngineConfig.from_cluster(cfg, "cpu")
    assert (c.kv_load, c.load_threads, c.max_model_len, c.load_failure_policy) == ("sync", 3, 2048, "fail")
    assert c.model == cfg.workers.model and c.receive_timeout_s == cfg.transport.transfer_timeout_s


def test_connector_settings_round_trip_and_name_the_bad_key():
    s = ConnectorSettings("smollm2-135m", 5.0, "async", 2, inbox_key="k1")
    extra = s.to_extra()
    assert extra["kvnotes_kv_load"] == "async" and type(extra["kvnotes_kv_load"]) is str
    assert ConnectorSettings.from_extra(extra) == s
    with pytest.raises(ValueError, match="kvnotes_model, kvnotes_receive_timeout_s"):
        ConnectorSettings.from_extra({"kvnotes_kv_load": "async", "kvnotes_load_threads": 2})
    with pytest.raises(ValueError, match="kvnotes_kv_load"):
        ConnectorSettings.from_extra({**extra, "kvnotes_kv_load": "eventually"})
    with pytest.raises(ValueError, match="kvnotes_load_threads"):
        ConnectorSettings.from_extra({**extra, "kvnotes_load_threads": 0})
    with pytest.raises(ValueError, match="kvnotes_grpc_port"):         # no inbox key: it must serve one of its own
        ConnectorSettings.from_extra({**extra, "kvnotes_inbox_key": ""})


def test_load_params():
    assert load_params("t1", 12) == {"kvnotes_transfer_id": "t1", "kvnotes_prefix_tokens": 12}
    assert load_params("t1", 12, KVLoadMode.SYNC)["kvnotes_kv_load"] == "sync"
    with pytest.raises(ValueError):
        load_params("t1", 0)
    with pytest.raises(ValueError, match="kv_load"):
        load_params("t1", 3, "soon")


class _Inbox(KVReceiver):
    def receive(self, transfer_id, *, timeout):
        raise AssertionError("not called")


def test_the_inbox_travels_by_key_and_a_missing_key_is_an_error():
    reg = InboxRegistry()
    inbox = _Inbox()
    key = reg.register(inbox)
    assert reg.get(key) is inbox and reg.register(_Inbox()) != key
    reg.release(key)
    with pytest.raises(LookupError, match=key):
        reg.get(key)
    with pytest.raises(ValueError, match="KVReceiver"):
        reg.register(object())
