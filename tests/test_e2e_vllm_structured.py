"""The structured-output and tool-call tests of ``test_e2e_structured`` against a cluster whose
decode engine is vLLM (``decode_engine: vllm``: the constraint becomes vLLM's own
``StructuredOutputsParams``)."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.conftest import http_client  # noqa: E402
from tests.test_e2e_structured import (  # noqa: E402,F401  (the same tests, collected here on this cluster)
    start_cluster, test_bad_structured_requests_are_4xx_with_a_message, test_json_object_native_endpoint_and_a_cut_answer,
    test_json_schema_answers_validate_and_stream_the_same, test_n_choices, test_named_tool_call_then_the_answer_with_its_result,
    test_required_and_auto)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    from cluster.ops.launcher import stop
    cfg = start_cluster(tmp_path_factory, tier_cpu_bytes=128 << 20, decode_engine="vllm", vllm_kv_cache_gib=1,
                        vllm_max_model_len=4096)
    http = http_client(cfg)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1", api_key=http.headers["authorization"].split()[1],
                            max_retries=0, timeout=600), http
    finally:
        http.close()
        stop(cfg)
