"""``balanced`` edits a found edit in place on the vLLM decode engine where the shipped profile
approves it: Gemma-3-270M (its ``field + top-16`` row meets the answer target; SmolLM2's misses,
tests/test_e2e_vllm_prompt_match.py) through the official `openai` client (plain completions: the
shipped Gemma-3 is the base model) against the real embedded cluster with ``decode_engine: vllm``.
A cold prompt vLLM computes alone is stored in the tier behind it; a one-field change of it is
planned as edit-in-place of the held KV with the row cited in ``explain``, its KV built by the
prefill worker and loaded into vLLM's paged cache through the kvnotes connector; the reuse is
counted as ``edited`` in ``usage`` and the metrics."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.conftest import cluster_port, http_client, metric, wait_for  # noqa: E402
from tests.test_e2e_default_compose import record  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
ROW = "balanced: gemma3-270m edit_answers row 'field + top-16' meets the answer target"


@pytest.fixture(scope="module")
def gemma_vllm(tmp_path_factory, local_ray):
    import openai
    from cluster.control.state import open_state
    from cluster.http.auth import create_key
    from kvruntime.config import ClusterConfig
    from tests.conftest import release_kept, start_cluster, stop_cluster

    for name in ("default_cluster", "vllm_cluster"):      # one cluster per Ray: a kept one goes first
        release_kept(name)
    cfg = ClusterConfig.of(model=MODEL, port=cluster_port(), tier_cpu_bytes=128 << 20, decode_engine="vllm",
                           vllm_kv_cache_bytes=1 << 30, vllm_max_model_len=4096,
                           data_dir=str(tmp_path_factory.mktemp("state")))
    start_cluster(cfg, local_cpus=4)
    http = http_client(cfg)
    try:
        assert http.get("/health").json()["status"] == "ok"
        store = open_state(cfg.state.resolved_url)
        key, _ = create_key(store, "gv-edit-tenant")
        store.close()
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1", api_key=key, max_retries=0,
                            timeout=600), http
    finally:
        http.close()
        stop_cluster(cfg)


def complete(client, status: str, policy: str):
    r = client.completions.create(model=MODEL, max_tokens=4, temperature=0, prompt=record(status)
                                  + "\n\nWhat is the order batch's status?",
                                  extra_body={"kv_policy": policy, "explain": True})
    d = r.to_dict()
    return d, d["kvnotes"]["explain"], d["usage"]["prompt_tokens_details"]


def test_balanced_edits_a_held_prompt_in_place_on_vllm_where_the_gemma_profile_approves_it(gemma_vllm):
    client, http = gemma_vllm
    stored = metric(http.get("/metrics").text, "kvnotes_prompt_stores_total", outcome="stored")
    _, first, _ = complete(client, "in transit", "balanced")
    assert not first["steps"] and any("decode engine computes all" in n for n in first["notes"]), first
    wait_for(lambda: metric(http.get("/metrics").text, "kvnotes_prompt_stores_total", outcome="stored") > stored,
             240, "the prompt vLLM computed alone, compiled into the tier behind it")
    m0 = http.get("/metrics").text
    d, ex, details = complete(client, "delivered", "balanced")
    said = (ex["notes"], [(s["kind"], s["tokens"], s["reason"]) for s in ex["steps"]])
    assert ex["policy"] == "balanced" and ex["kind"] == "edit_in_place" and not ex["exact"], said
    step = next(s for s in ex["steps"] if s["kind"] == "edit_in_place")
    assert ROW in step["reason"] and "top-1 agreement 100%" in step["reason"], said
    assert any("first divergence" in n and "token " in n for n in ex["notes"]), said
    assert any(n.startswith("edit_strategy auto (the default") and "planned edit-in-place under policy balanced" in n
               for n in ex["notes"]), said
    assert details["edited_tokens"] > 0.8 * ex["prompt_tokens"], details
    assert details["cached_tokens"] == details["exact_tokens"] + details["composed_tokens"] + details["edited_tokens"]
    assert d["choices"][0]["text"] and d["kvnotes"]["fallbacks"] == [], d["kvnotes"]   # loaded into vLLM as planned
    assert metric(http.get("/metrics").text, "kvnotes_reused_tokens_total", kind="edited") - \
        metric(m0, "kvnotes_reused_tokens_total", kind="edited") == details["edited_tokens"]
