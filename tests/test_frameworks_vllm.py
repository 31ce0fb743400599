"""The framework tests of ``test_frameworks`` against a cluster whose decode engine is vLLM
(``decode_engine: vllm``: constraints become vLLM's own structured-output parameters)."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.test_e2e_vllm_cluster import vllm_cluster  # noqa: E402,F401  (the kept vLLM cluster)
from tests.test_frameworks import (  # noqa: E402,F401  (the same tests, collected here on this cluster)
    test_agents_sdk_default_settings_with_a_tool, test_agents_sdk_output_type,
    test_agents_sdk_streams_on_the_responses_model, test_agents_sdk_tool_call_and_its_result,
    test_instructor_json_mode, test_instructor_schema_and_tool_modes, test_langchain_bind_tools_and_streaming,
    test_langchain_with_structured_output, test_pydantic_ai_outputs_beside_a_function_tool)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def endpoint(vllm_cluster):
    from tests.conftest import api_key
    return f"http://127.0.0.1:{vllm_cluster.server.port}/v1", api_key(vllm_cluster)
