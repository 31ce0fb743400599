"""What a worker actor's start no longer does, and that no check went with it: the prefill RoPE
self-test on two tokens still refuses every wrong table by a wide margin; the decode reference
engine runs no self-test and so never trusts a rotation; the router's Serve deployment stops with
the configured drain loop (``server.router_shutdown_wait_loop_s``), not Serve's 2 s."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import metric
from tests.test_rope_selftest import _wrong_tables


def test_router_shutdown_wait_loop_is_a_checked_config_key():
    from kvruntime.config import ClusterConfig

    assert ClusterConfig.of(port=8000).server.router_shutdown_wait_loop_s == 0.5
    assert ClusterConfig.of(port=8000, router_shutdown_wait_loop_s=2.0).server.router_shutdown_wait_loop_s == 2.0
    for bad in (0, -1.0, 61.0):
        with pytest.raises(ValueError, match="router_shutdown_wait_loop_s"):
            ClusterConfig.of(port=8000, router_shutdown_wait_loop_s=bad)


@pytest.mark.slow
def test_the_default_self_test_refuses_every_wrong_table_and_passes_the_real_one(smol):
    """Two one-token forwards per position (kvruntime.rope.SELF_TEST_TOKENS): each wrong table
    (base, sign, 1% frequency, half layout) is more than 1000x over the fp32 tolerance."""
    from kvruntime.rope import SELF_TEST_TOKENS, self_test, self_test_tolerance

    tol = self_test_tolerance(smol.dtype, 3001 + SELF_TEST_TOKENS)
    for name, table in _wrong_tables(smol.rope).items():
        assert self_test(smol, table) is False, name
        assert table.enabled is False and table.self_test_error > 1000 * tol, (name, table.self_test_error)
    assert self_test(smol, smol.rope) is True
    assert smol.rope.enabled and smol.rope.self_test_error < tol


@pytest.mark.slow
def test_the_decode_reference_engine_never_trusts_an_unchecked_rotation():
    from decode_workers.engines import make_decode_engine
    from kvruntime.config import ClusterConfig
    from kvruntime.rope import RepositionDisabled

    ex = make_decode_engine(ClusterConfig.of(port=8000), None, "cpu")
    e = ex.engine
    assert e.rope.enabled is False and e.rope.self_test_error is None      # never run, never trusted
    with pytest.raises(RepositionDisabled):
        e.rope.rotate(torch.zeros(e.num_layers, e.kv_heads, 1, e.head_dim), 1)
    ids = e.encode("The capital of France is")
    out = e.prefill(ids, torch.arange(len(ids)), logits=True)             # decoding itself is untouched
    assert e.decode([int(out.logits.argmax())]).strip() == "Paris"


@pytest.mark.slow
def test_the_running_router_drains_with_the_configured_loop_and_prefill_passed_its_self_test(default_cluster):
    from ray.serve.context import _get_global_client

    cfg, client = default_cluster
    details = _get_global_client().get_serve_details()
    deps = details["applications"]["kvnotes"]["deployments"]
    assert deps["kvnotes-router"]["deployment_config"]["graceful_shutdown_wait_loop_s"] == \
        cfg.server.router_shutdown_wait_loop_s == 0.5
    text = client.get("/metrics").text
    assert metric(text, "kvnotes_rope_selftest_ok", worker="prefill-0") == 1
