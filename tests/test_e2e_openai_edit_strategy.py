"""``edit_strategy`` through the official `openai` client (``extra_body``) against the real
embedded cluster (Ray actors, Serve router, LMCache tier, SmolLM2 on the reference decode engine:
the default cluster, kept for the modules that share it). A chat prompt one field away from a
held one, with ``edit_strategy: erratum`` asked for, is planned as the erratum under ``fast``
(the held prompt reused whole + the correction) and declined under ``balanced``, whose shipped
SmolLM2 row for the erratum misses the answer target: recomputed from the divergence after the
exact prefix, the row cited. A bad value is an OpenAI-shaped 400 on every OpenAI endpoint, with
the request id, and nothing runs."""
import pytest

from tests.conftest import metric
from tests.test_e2e_prompt_match import record, split_sums

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ROW = "smollm2-135m edit_answers row 'erratum: correction' misses the answer target"
ASKED = "edit_strategy erratum (asked by the caller: the held prompt + an appended correction): planned "


@pytest.fixture(scope="module")
def editor(default_cluster):
    import openai
    from cluster.control.state import open_state
    from cluster.http.auth import create_key

    cfg, http = default_cluster
    store = open_state(cfg.state.resolved_url)
    key, _ = create_key(store, "es-edit-tenant")        # its first prompt is stored in the tier: the held one
    store.close()
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1", api_key=key, max_retries=0,
                         timeout=600), http


def ask(client, status: str, policy: str, strategy: str | None = None):
    extra = {"kv_policy": policy, "explain": True, **({"edit_strategy": strategy} if strategy else {})}
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, extra_body=extra, messages=[
        {"role": "system", "content": record(status)}, {"role": "user", "content": "What is the shipment's status?"}])
    d = r.to_dict()
    return d["kvnotes"]["explain"], d["usage"]["prompt_tokens_details"]


def test_the_erratum_asked_for_is_planned_under_fast_and_declined_under_balanced_with_the_row_cited(editor):
    client, _ = editor
    held, _ = ask(client, "in transit", "exact")         # computed whole, stored exactly
    n_held = held["prompt_tokens"] - held["suffix_tokens"]
    ex, details = ask(client, "delivered", "fast", "erratum")
    said = (ex["notes"], [(s["kind"], s["tokens"], s["reason"]) for s in ex["steps"]])
    assert [s["kind"] for s in ex["steps"]] == ["reuse", "erratum"], said
    assert ex["steps"][0]["tokens"] == n_held and ex["steps"][0]["reused"] == n_held, said   # the held prompt, whole
    assert "requested by the caller" in ex["steps"][1]["reason"] and ROW in ex["steps"][1]["reason"], said
    assert any("first divergence" in n and "message 0 (system)" in n for n in ex["notes"]), said
    assert any(n.startswith(ASKED + "the erratum under policy fast") for n in ex["notes"]), said
    assert details["edited_tokens"] > 0 and details["cached_tokens"] >= 0.8 * n_held and split_sums(details), details
    # balanced: the shipped row misses, so the same request is recomputed from the divergence
    ex, details = ask(client, "returned", "balanced", "erratum")
    said = (ex["notes"], [(s["kind"], s["tokens"], s["reason"]) for s in ex["steps"]])
    assert not any(s["kind"] in ("erratum", "edit_in_place") for s in ex["steps"]) and ex["exact"], said
    assert any(n.startswith("erratum requested but not planned (balanced: " + ROW) for n in ex["notes"]), said
    shared = ex["steps"][0]
    assert shared["kind"] == "reuse" and shared["reason"].startswith("exact prefix of the held prompt"), said
    assert any(n.startswith(ASKED + f"the exact prefix ({shared['reused']} tokens) + a recompute from the divergence "
                                    "under policy balanced") for n in ex["notes"]), said
    assert details["exact_tokens"] == details["cached_tokens"] >= shared["reused"] >= 256, details


def test_a_bad_edit_strategy_is_an_openai_400_with_the_request_id_on_every_endpoint(editor):
    import openai
    client, http = editor
    before = http.get("/metrics").text
    calls = {
        "chat": lambda x: client.chat.completions.create(model=MODEL, max_tokens=2, extra_body=x,
                                                         messages=[{"role": "user", "content": "hi"}]),
        "completions": lambda x: client.completions.create(model=MODEL, max_tokens=2, prompt="hi", extra_body=x),
        "responses": lambda x: client.responses.create(model=MODEL, input="hi", extra_body=x),
    }
    for name, call in calls.items():
        for bad in ("guess", 7):
            with pytest.raises(openai.BadRequestError) as e:
                call({"edit_strategy": bad})
            err = e.value.response.json()["error"]
            assert e.value.status_code == 400 and err["param"] == "edit_strategy", (name, err)
            assert err["message"] == "edit_strategy must be one of auto, erratum, edit_in_place", (name, err)
            assert err["request_id"] and err["request_id"] == e.value.response.headers["x-request-id"], (name, err)
    after = http.get("/metrics").text
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    # each counted as a rejected request that planned nothing; no prompt token computed or reused
    assert delta("kvnotes_requests_total") == delta("kvnotes_requests_total", plan="none", status="client_error") == 6
    for name in ("kvnotes_prompt_tokens_total", "kvnotes_reused_tokens_total", "kvnotes_ttft_seconds_count"):
        assert delta(name) == 0, name
