"""``vllm_decode_tail`` (issue 44): the tokens at the end of a composed prompt's last spliced step
the vLLM decode engine may compute in context itself (vLLM's prefix cache holds whole blocks, which
end before the splice does), a typed config key in kvruntime.config.workers, checked there in vLLM
block units, and the one value the router's runner uses (``lifecycle.decode_may_compute_from``)."""
import asyncio

import pytest

from cluster.control.context import RequestContext
from cluster.control.lifecycle import DECODE_TAIL, PlannedRequest, RequestRunner, _Run, decode_may_compute_from
from cluster.control.metrics import Metrics
from cluster.control.routing import FaultPolicy
from kvruntime.config import ClusterConfig, WorkersConfig
from kvruntime.config.workers import VLLM_BLOCK_UNIT
from kvruntime.messages.decode import SamplingParams
from kvruntime.messages.transfer import ExpectReply
from tests.test_store_behind import _plan, _rc, _repos


def test_the_decode_tail_is_a_config_key_in_vllm_block_units():
    assert WorkersConfig().vllm_decode_tail == DECODE_TAIL == 128          # one block of vLLM on the CPU
    assert ClusterConfig.of(vllm_decode_tail=256).workers.vllm_decode_tail == 256
    assert ClusterConfig.from_dict({"workers": {"vllm_decode_tail": 0}}).workers.vllm_decode_tail == 0   # off
    assert ClusterConfig.of(vllm_decode_tail=16).workers.vllm_decode_tail == 16                          # CUDA's block
    for bad in (100, -16, True, "128", 1.5 * 128, 8192):
        with pytest.raises(ValueError, match=f"vllm_decode_tail must be 0 \\(off\\) or a positive multiple of "
                                             f"{VLLM_BLOCK_UNIT} below vllm_max_model_len") as e:
            ClusterConfig.of(vllm_decode_tail=bad)
        assert "128 on the CPU" in str(e.value)
    assert ClusterConfig.of(vllm_decode_tail=4096, vllm_max_model_len=8192).workers.vllm_decode_tail == 4096
    with pytest.raises(ValueError, match="below vllm_max_model_len \\(2048\\)"):
        ClusterConfig.of(vllm_decode_tail=2048, vllm_max_model_len=2048)


def test_the_decode_engine_computes_as_far_back_as_the_configured_tail():
    turn = _plan([_rc(0, 30), _repos(30, 1050), _rc(1080, 480)])      # a conversation composed the same way
    assert decode_may_compute_from(turn, 256) == 1080 - 256
    assert decode_may_compute_from(turn, 0) == 1080                    # off: from the end of the splice
    assert decode_may_compute_from(_plan([_rc(0, 30), _repos(30, 1050), _rc(1080, 200)]), 256) == 1080  # < tail past it


class _Expecting:
    """Backends whose decode worker records what it is told to expect."""
    def __init__(self):
        self.told = []

    async def expect(self, index, expectation):
        self.told.append(expectation)
        return ExpectReply(0, False)


@pytest.mark.parametrize("tail", [0, 128, 256])
def test_the_runner_tells_the_decode_worker_the_configured_tail(tail):
    b = _Expecting()
    runner = RequestRunner(b, None, FaultPolicy(), Metrics(), "float32", None, "default", decode_tail=tail)
    plan = _plan([_rc(0, 30), _repos(30, 1050), _rc(1080, 480)])
    job = PlannedRequest(plan, SamplingParams(max_tokens=4), None, 0, "s" * 32, 0.0)
    asyncio.run(runner.grant(RequestContext.local(), job, _Run(float("inf"), "kv", 0), 0, "t-1"))
    assert b.told[0].computes_from == 1080 - tail


def test_the_router_takes_the_tail_from_its_policy_section():
    from cluster.control.router_sections import PolicySection
    assert PolicySection().decode_tail == DECODE_TAIL and PolicySection(decode_tail=256).decode_tail == 256
