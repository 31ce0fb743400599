"""``test_e2e_echo_logprobs`` on a cluster whose decode engine is vLLM: the prompt's log-probs
come from the prefill worker (a full recompute there), the completion's from vLLM."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.test_e2e_echo_logprobs import check_echo_logprobs  # noqa: E402
from tests.test_e2e_vllm_cluster import vllm_cluster  # noqa: E402,F401  (the kept vLLM cluster)

pytestmark = pytest.mark.slow


def test_echo_with_logprobs_on_vllm_decode(vllm_cluster):
    import openai

    from tests.conftest import api_key, http_client
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{vllm_cluster.server.port}/v1", api_key=api_key(vllm_cluster),
                       max_retries=0, timeout=600)
    with http_client(vllm_cluster) as http:
        check_echo_logprobs(oa, http)
