"""The ``/v1/responses``, constraint and batch tests of ``test_e2e_responses`` against a cluster
whose decode engine is vLLM."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.test_e2e_responses import (  # noqa: E402,F401  (the same tests, collected here on this cluster)
    test_bad_responses_bodies_are_4xx_naming_the_field, test_completions_batch_and_echo,
    test_function_call_streamed_then_its_output_answered, test_text_stored_read_continued_and_deleted,
    test_the_stream_parses_with_responses_stream_and_matches, test_unlisted_properties_are_refused_and_parallel_calls_bounded)
from tests.test_e2e_vllm_cluster import vllm_cluster  # noqa: E402,F401  (the kept vLLM cluster)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(vllm_cluster):
    import openai

    from tests.conftest import api_key
    return openai.OpenAI(base_url=f"http://127.0.0.1:{vllm_cluster.server.port}/v1", api_key=api_key(vllm_cluster),
                         max_retries=0, timeout=600)
