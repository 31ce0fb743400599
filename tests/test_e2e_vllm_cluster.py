"""The embedded cluster with ``decode_engine: vllm``: HTTP -> Serve router -> prefill actor ->
gRPC -> the kvnotes connector inside a vLLM engine in the decode actor -> tokens streamed back."""
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from tests.conftest import cluster_port, http_client, kept  # noqa: E402
from tests.test_e2e_cluster import MEMORY, SKILL, _direct, _metric  # noqa: E402

pytestmark = pytest.mark.slow


def _vllm_cluster(tmp_path_factory):
    from kvruntime.config import ClusterConfig
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray

    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, decode_engine="vllm",
                           vllm_kv_cache_bytes=1 << 30, vllm_max_model_len=4096, data_dir=str(tmp_path_factory.mktemp("state")))
    start(cfg, local_cpus=4)
    try:
        yield cfg
    finally:
        stop(cfg)


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory, local_ray):
    """The embedded cluster with ``decode_engine: vllm`` (its decode actor builds a vLLM engine,
    tens of seconds), kept for the modules that ask for it: this one and test_e2e_vllm_structured,
    whose tests only add names of their own and read counters as deltas."""
    return kept("vllm_cluster", lambda: _vllm_cluster(tmp_path_factory))


@pytest.fixture(scope="module")
def vcluster(vllm_cluster):
    client = http_client(vllm_cluster)
    try:
        for kind, body in (("skills", {"name": "refund", "text": SKILL}), ("memories", {"name": "dana", "text": MEMORY})):
            assert client.post(f"/v1/{kind}", json=body).status_code == 201
        yield client
    finally:
        client.close()


def test_vllm_decode_actor_serves_exact_and_composed_requests(vcluster):
    http = vcluster
    body = {"segments": [{"skill": "refund"}, {"memory": "dana"}, {"text": "Can Dana return the headphones?"}],
            "max_tokens": 16, "temperature": 0, "explain": True}
    exact = http.post("/v1/notes/completions", json={**body, "kv_policy": "exact"}).json()
    assert exact["plan"] == "reuse" and exact["explain"]["exact"], exact     # the skill: frame variant, exact
    from tests.conftest import get_engine
    e = get_engine("smollm2-135m")
    ids = (e.encode(e.spec.chat_user_prefix) + e.encode(SKILL.strip() + "\n\n") + e.encode(MEMORY.strip() + "\n\n")
           + e.encode("Can Dana return the headphones?" + e.spec.chat_user_suffix))
    assert exact["text"] == _direct(ids, 16)                   # vLLM fp32 = reference engine on exact KV
    fast = http.post("/v1/notes/completions", json={**body, "kv_policy": "fast"}).json()
    assert fast["plan"] == "reposition" and fast["usage"]["prompt_tokens_details"]["cached_tokens"] > 40, fast
    assert fast["text"].strip()
    again = http.post("/v1/notes/completions", json={**body, "kv_policy": "fast"}).json()
    assert again["text"] == fast["text"]
    # streamed over SSE through the threaded actor
    with http.stream("POST", "/v1/notes/completions", json={**body, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and events[-1] == "data: [DONE]"
    metrics = http.get("/metrics").text
    assert _metric(metrics, "kvnotes_fallbacks_total") == 0, "a composed prefix fell back to recompute"
    assert http.get("/health").json()["status"] == "ok"


PRICES = " ".join(f"Item {i} costs {i * 7 % 100} dollars." for i in range(120))    # ~1k tokens


def test_a_repeated_composed_prefix_is_not_sent_twice(vcluster):
    """The decode actor tells the router what vLLM's prefix cache already holds of the prefix;
    the prefill actor then ships only the rest (fewer bytes), and the answer is the same."""
    http = vcluster
    assert http.post("/v1/skills", json={"name": "prices", "text": PRICES}).status_code == 201
    body = {"segments": [{"text": "Price list follows.\n"}, {"skill": "prices"}, {"text": "What does item 3 cost?"}],
            "max_tokens": 6,
            "temperature": 0, "kv_policy": "fast", "explain": True}

    def sent() -> float:
        return _metric(http.get("/metrics").text, "kvnotes_kv_transfer_bytes_total")

    b0 = sent()
    first = http.post("/v1/notes/completions", json=body).json()
    b1 = sent()
    second = http.post("/v1/notes/completions", json=body).json()
    b2 = sent()
    # the repeat reuses the context the first one composed, whole (the same bytes, the same salt)
    assert first["plan"] == "reposition" and second["plan"] == "reuse" and second["text"] == first["text"], second
    assert b1 - b0 > 0 and 0 < b2 - b1 < (b1 - b0) / 2, (b0, b1, b2)      # only the tail travelled again
    assert second["explain"]["transport"] in ("nixl", "grpc") and "transfer" in second["explain"]["stages"]
    assert _metric(http.get("/metrics").text, "kvnotes_fallbacks_total") == 0


def test_vllm_engine_metrics_reach_prometheus(vcluster, tmp_path):
    """The decode actor serves vLLM's own engine metrics on its endpoint; Prometheus discovers it
    through the router, and every query of the dashboard's vLLM row returns series."""
    import time

    from cluster.operator.dashboard import ROWS
    from tests.conftest import prom_query, prometheus_server, sd_prometheus_config

    http = vcluster
    base = str(http.base_url).rstrip("/")
    r = http.post("/v1/notes/completions", json={"segments": [{"skill": "refund"}, {"text": "Refund?"}],
                                                 "max_tokens": 2, "temperature": 0, "kv_policy": "fast"})
    assert r.status_code == 200, r.text                  # a composed prefix through the connector
    groups = http.get("/metrics/targets").json()
    decode = [g["targets"][0] for g in groups if g["labels"]["kvnotes_role"] == "decode"]
    assert len(decode) == 1, groups
    import httpx
    own = httpx.get(f"http://{decode[0]}/metrics", timeout=30).text
    assert _metric(own, "vllm:prefix_cache_queries_total") > 0 and _metric(own, "vllm:external_prefix_cache_hits_total") > 0
    assert _metric(own, "vllm:time_to_first_token_seconds_count") > 0
    row = next(r for r in ROWS if r.title.startswith("vLLM"))
    # 2 s scrapes: a scrape's timeout is at most its interval, and a busy vLLM actor answers slowly
    with prometheus_server(sd_prometheus_config(base, "2s"), tmp_path / "prom") as prom:
        deadline = time.monotonic() + 90
        while True:
            http.post("/v1/notes/completions", json={"segments": [{"skill": "refund"}, {"text": "Refund?"}],
                                                     "max_tokens": 2, "temperature": 0, "kv_policy": "fast"})
            empty = [q.expr for p in row.panels for q in p.queries if not prom_query(prom, q.expr)]
            if not empty:
                break
            if time.monotonic() > deadline:
                targets = httpx.get(f"{prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
                names = prom_query(prom, 'count by (__name__) ({kvnotes_role="decode"})')
                raise AssertionError(f"vLLM panel queries without series: {empty}; targets: "
                                     f"{[(t['labels'], t['health'], t['lastError']) for t in targets]}; "
                                     f"decode series: {[n['metric'].get('__name__') for n in names]}")
            time.sleep(2)


def test_cached_tokens_count_the_decode_engines_own_prefix_cache(vcluster):
    """A plain prompt too short for the kvnotes prompt index (< 256 tokens) but longer than one vLLM
    block, sent twice: the second is served from vLLM's own prefix cache, and usage says so."""
    from tests.conftest import metric
    http = vcluster
    prompt = " ".join(f"Locker {i} holds {i * 3} boxes." for i in range(18)) + " Which locker holds 9 boxes?"
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()
    assert 128 < first["usage"]["prompt_tokens"] < 256, first["usage"]
    before = metric(http.get("/metrics").text, "kvnotes_prompt_tokens_total", source="decode_cache")
    second = http.post("/v1/completions", json=body).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    hit = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit >= 128 and hit % 16 == 0, second["usage"]           # whole vLLM blocks
    assert metric(http.get("/metrics").text, "kvnotes_prompt_tokens_total", source="decode_cache") - before == hit


def test_a_cold_prompt_is_computed_by_vllm_alone(vcluster):
    """Cold-prompt parity guard: a prompt that reuses nothing (no registered chunk, no cached
    prefix, no session) goes straight to the vLLM decode engine: no prefill stage runs, no KV
    block travels, and vLLM counts every prompt token as computed by itself."""
    import httpx

    from tests.conftest import metric
    http = vcluster
    text = " ".join(f"Shelf {i} holds {i * 11 % 97} jars of cold plum jam." for i in range(40))
    body = {"segments": [{"text": text}, {"text": "Which shelf holds 44 jars?"}], "max_tokens": 4,
            "temperature": 0, "kv_policy": "balanced", "explain": True}
    groups = http.get("/metrics/targets").json()
    decode = [g["targets"][0] for g in groups if g["labels"]["kvnotes_role"] == "decode"]

    def counters():
        own = httpx.get(f"http://{decode[0]}/metrics", timeout=30).text
        router = http.get("/metrics").text
        return {"bytes": metric(router, "kvnotes_kv_transfer_bytes_total"),
                "computed": metric(router, "kvnotes_prompt_tokens_total", source="computed"),
                "vllm_prompt": metric(own, "vllm:prompt_tokens_total"),
                "vllm_external": metric(own, "vllm:external_prefix_cache_hits_total")}

    before = counters()
    r = http.post("/v1/notes/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    ex = out["explain"]
    n = out["usage"]["prompt_tokens"]
    assert n > 300 and out["plan"] == "recompute" and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ex["steps"] == [] and ex["suffix_tokens"] == n and ex["transport"] == "", ex
    assert not {"tier_get", "forward", "serialise", "transfer", "receive", "load"} & set(ex["stages"]), ex["stages"]
    after = counters()
    assert after["bytes"] == before["bytes"], "a KV block travelled for a cold prompt"
    assert after["vllm_external"] == before["vllm_external"]
    assert after["computed"] - before["computed"] == n
    assert after["vllm_prompt"] - before["vllm_prompt"] == n          # vLLM computed (or counted) all of it
