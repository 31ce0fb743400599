"""The structured-output and tool-call tests of ``test_e2e_structured`` against a cluster whose
decode engine is vLLM (``decode_engine: vllm``: the constraint becomes vLLM's own
``StructuredOutputsParams``)."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.conftest import http_client  # noqa: E402
from tests.test_e2e_structured import (  # noqa: E402,F401  (the same tests, collected here on this cluster)
    test_bad_structured_requests_are_4xx_with_a_message, test_json_object_native_endpoint_and_a_cut_answer,
    test_json_schema_answers_validate_and_stream_the_same, test_n_choices, test_named_tool_call_then_the_answer_with_its_result,
    test_required_and_auto)
from tests.test_e2e_vllm_cluster import vllm_cluster  # noqa: E402,F401  (one kept cluster for both modules)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(vllm_cluster):
    """The openai client and an httpx one on the kept vLLM cluster (tier 128 MiB, vLLM KV 1 GiB,
    max_model_len 4096: the settings this module always used)."""
    import openai

    http = http_client(vllm_cluster)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{vllm_cluster.server.port}/v1",
                            api_key=http.headers["authorization"].split()[1], max_retries=0, timeout=600), http
    finally:
        http.close()
