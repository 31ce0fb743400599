"""Prefill and decode actors on a GPU when Ray gives them one (issue 32 part 6), checked on CPU:
``device: auto|cpu|cuda`` per role resolves against what torch sees and what Ray assigned (both
replaced here), the actor options carry ``num_gpus``, bad settings are clear errors, and KV leaves
the engine for the tier and the transport through kvruntime.staging (pinned memory from a GPU;
on the CPU the plain path, exact)."""
from __future__ import annotations

import logging

import pytest
import torch

from kvruntime.device import DeviceUnavailable, resolve_device
from kvruntime.config import ClusterConfig, WorkerConfig


def _resolve(requested, cuda, ids, role="prefill"):
    return resolve_device(requested, role, cuda=lambda: cuda, gpu_ids=lambda: ids)


def test_auto_is_cuda_only_when_torch_sees_cuda_and_ray_assigned_a_gpu(caplog):
    assert _resolve("auto", True, [0]) == "cuda"
    assert _resolve("auto", True, []) == "cpu"          # a GPU on the node, none reserved by this actor
    assert _resolve("auto", True, None) == "cpu"        # not a Ray actor
    assert _resolve("auto", False, None) == "cpu"
    with caplog.at_level(logging.WARNING, logger="kvruntime.device"):
        assert _resolve("auto", False, [1]) == "cpu"    # reserved, but a CPU build of torch: logged
    assert any("Ray assigned GPU(s) [1] but torch sees no CUDA device" in r.getMessage() for r in caplog.records)


def test_cuda_is_the_assigned_gpu_or_a_clear_error():
    assert _resolve("cuda", True, [0]) == "cuda"
    assert _resolve("cuda", True, None) == "cuda"       # outside Ray: torch's own view decides
    with pytest.raises(DeviceUnavailable, match=r"prefill.device is cuda but torch sees no CUDA device.*\[0\]"):
        _resolve("cuda", False, [0])
    with pytest.raises(DeviceUnavailable, match=r"decode.device is cuda but Ray assigned this actor no GPU.*"
                                                r"decode.num_gpus"):
        _resolve("cuda", True, [], role="decode")


def test_cpu_is_cpu_whatever_is_assigned_and_unknown_is_refused():
    assert _resolve("cpu", True, [0]) == "cpu"
    with pytest.raises(ValueError, match="prefill.device must be one of auto, cpu, cuda"):
        _resolve("gpu", True, [0])


def test_real_probes_on_this_host():
    """Unpatched: the driver process is no Ray worker here, so auto is the CPU; cuda fails unless a GPU exists."""
    import ray
    if not ray.is_initialized():
        assert resolve_device("auto", "prefill") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable):
            resolve_device("cuda", "prefill")


def test_config_device_and_num_gpus_per_role():
    cfg = ClusterConfig.from_dict({"prefill": {"num_gpus": 1, "device": "cuda"}, "decode": {"device": "cpu"}})
    assert (cfg.workers.prefill.device, cfg.workers.prefill.num_gpus, cfg.workers.decode.device) == ("cuda", 1, "cpu")
    assert ClusterConfig().workers.prefill.device == ClusterConfig().workers.decode.device == "auto"
    with pytest.raises(ValueError, match="prefill.device must be one of auto, cpu, cuda, got 'gpu'"):
        ClusterConfig.from_dict({"prefill": {"device": "gpu"}})
    with pytest.raises(ValueError, match="decode.device: cuda needs decode.num_gpus > 0"):
        ClusterConfig.from_dict({"decode": {"device": "cuda"}})
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        ClusterConfig.of(prefill=WorkerConfig(num_gpus=-1))


def test_actor_options_carry_num_gpus():
    from cluster.control.ray_backends import _options, worker_resources
    cfg = ClusterConfig.from_dict({"prefill": {"num_gpus": 1, "num_cpus": 4, "device": "cuda",
                                               "custom_resource": True},
                                   "decode": {"num_gpus": 0.5}})
    p = _options(cfg, cfg.workers.prefill, "prefill", "prefill-0")
    assert (p["num_gpus"], p["num_cpus"], p["resources"]) == (1, 4, {"prefill": 1})
    assert _options(cfg, cfg.workers.decode, "decode", "decode-0")["num_gpus"] == 0.5
    assert worker_resources(cfg, "prefill") == {"CPU": 4.0, "GPU": 1.0, "prefill": 1.0}
    assert worker_resources(ClusterConfig(), "prefill") == {"CPU": 1.0}           # no GPU asked for by default


def test_actors_resolve_their_device_from_their_role():
    """The actors call resolve_device with their role's setting (read from the source: building an
    actor loads a model; the cluster tests start real ones on the CPU)."""
    import inspect
    import decode_workers.actor as d
    import prefill_workers.actor as p
    assert 'resolve_device(cfg.workers.prefill.device, "prefill")' in inspect.getsource(p.PrefillWorker.__init__)
    assert 'resolve_device(cfg.workers.decode.device, "decode")' in inspect.getsource(d.DecodeWorker.__init__)


# ---- staging -------------------------------------------------------------------------------------
def test_cpu_kv_takes_the_plain_path_exactly(monkeypatch):
    from kvruntime import staging
    pinned = []
    real_empty = torch.empty

    def _spy(*a, **kw):
        pinned.append(kw.get("pin_memory", False))
        return real_empty(*a, **kw)
    monkeypatch.setattr(staging.torch, "empty", _spy)
    data = torch.randn(3, 2, 2, 9, 16)
    before = staging.counts["cpu"]
    same = staging.to_host(data)
    assert same.data_ptr() == data.data_ptr()                    # contiguous, same dtype: no copy
    strided = data[:, 0]
    out = staging.to_host(strided)
    assert out.is_contiguous() and torch.equal(out, strided) and not out.is_pinned()
    half = staging.to_host(data, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, data.to(torch.bfloat16))
    assert staging.counts["cpu"] == before + 3 and not any(pinned)


def test_wire_and_tier_paths_go_through_staging(monkeypatch):
    """blocks (gRPC / NIXL payloads) and the LMCache store's put both call kvruntime.staging.to_host."""
    from kvruntime.kv import KVCache
    from kvtransport.transfer import blocks
    seen = []
    real = blocks.to_host
    monkeypatch.setattr(blocks, "to_host", lambda t, dtype=None: seen.append((tuple(t.shape), dtype)) or real(t, dtype))
    kv = KVCache(torch.randn(2, 2, 1, 5, 8), torch.arange(5), torch.arange(5))
    blk = blocks.encode_block("t1", "m", kv, dtype="bfloat16")
    assert seen == [((2, 2, 1, 5, 8), torch.bfloat16)]
    assert torch.equal(blocks.decode_block(blk).data, kv.data.to(torch.bfloat16))     # exact through the wire
    import inspect
    from kvtransport.tier.lmcache_store import LMCacheStore
    assert "to_host(kv.data)" in inspect.getsource(LMCacheStore.put)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kv_is_staged_through_pinned_memory_exactly():
    from kvruntime import staging
    data = torch.randn(4, 2, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    before = staging.counts["pinned"]
    host = staging.to_host(data[:, 0])
    assert host.device.type == "cpu" and host.is_pinned() and host.is_contiguous()
    assert torch.equal(host, data[:, 0].cpu())
    f32 = staging.to_host(data, torch.float32)
    assert f32.dtype == torch.float32 and torch.equal(f32, data.float().cpu())
    assert staging.counts["pinned"] == before + 2


def test_staging_paths_are_exported_per_worker():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from kvruntime import staging
    from prefill_workers.metrics import worker_registry
    stats = SimpleNamespace(hits_by_tier={}, misses={}, put_bytes=0, get_bytes=0, evictions=0, put_tier_failures={})
    store = SimpleNamespace(stats=stats, occupancy=lambda: {})
    staging.to_host(torch.zeros(3))
    text = generate_latest(worker_registry(store, "prefill-0", False)).decode()
    n = staging.counts["cpu"]
    assert f'kvnotes_worker_kv_staged_total{{path="cpu",worker="prefill-0"}} {float(n)}' in text
    assert 'kvnotes_worker_kv_staged_total{path="pageable_fallback",worker="prefill-0"} 0.0' in text
