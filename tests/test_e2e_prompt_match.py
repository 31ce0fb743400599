"""Prompt matching end to end: the official `openai` client against the real embedded cluster (Ray
actors, Serve router, gRPC KV transport, LMCache tier, SmolLM2; the default cluster, kept for the
modules that share it). A registered skill pasted into a system message is composed; a document
two chat prompts shared is compiled on its own and reused at another offset, for its tenant only;
a record one field away from a held one is planned as an edit under ``fast``; the reuse is split
by kind in ``usage``, ``explain`` and the router's metrics."""
import pytest

from tests.conftest import metric, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
SKILL = ("Warranty policy of Kestrel Audio: headphones carry a two year warranty from the date of purchase. "
         "A faulty pair is repaired or replaced free of charge when the receipt is shown. Damage from drops, "
         "water or cut cables is not covered. Repairs take ten working days; a loan pair is offered meanwhile. "
         "Batteries are covered for one year and are replaced at cost after that.")


def doc(topic: str) -> str:
    return "\n".join(f"{topic} entry {i}: the {topic} register puts crate {i * 7 % 31} in bay {i * 5 % 17}."
                     for i in range(14))


def record(status: str) -> str:
    lines = [f"line_{i}: reading {i * 37 % 101} for the shipment" for i in range(40)]
    lines.insert(30, f"status: {status}")
    return "Shipment record\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def rig(default_cluster):
    import openai
    from cluster.control.state import open_state
    from cluster.http.auth import create_key

    cfg, http = default_cluster
    base = f"http://127.0.0.1:{cfg.server.port}"
    r = http.post("/v1/skills", json={"name": "pm-warranty", "text": SKILL})
    assert r.status_code == 201, r.text
    store = open_state(cfg.state.resolved_url)
    other, _ = create_key(store, "pm-other-tenant")
    editor, _ = create_key(store, "pm-edit-tenant")
    store.close()
    key = http.headers["authorization"].split()[1]
    return (openai.OpenAI(base_url=base + "/v1", api_key=key), openai.OpenAI(base_url=base + "/v1", api_key=other),
            http, openai.OpenAI(base_url=base + "/v1", api_key=editor))


def chat(client, messages, policy="fast"):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"kv_policy": policy, "explain": True})
    d = r.to_dict()
    return d, d["kvnotes"]["explain"], d["usage"]["prompt_tokens_details"]


def recurring(http) -> dict[str, float]:
    """``kvnotes_recurring_spans_total`` by outcome: ``scheduled`` and each way a scheduled background
    compile ends (cluster.control.recurring.ENDS)."""
    from cluster.control.recurring import ENDS
    text = http.get("/metrics").text
    return {o: metric(text, "kvnotes_recurring_spans_total", outcome=o) for o in ("scheduled",) + ENDS}


def pending(outcomes: dict[str, float]) -> float:
    """Background compiles scheduled and not ended yet (cluster.control.recurring.pending)."""
    from cluster.control.recurring import pending as queued
    return queued(outcomes)


def split_sums(details) -> bool:
    return details["cached_tokens"] == details["exact_tokens"] + details["composed_tokens"] + details["edited_tokens"]


def test_a_skill_pasted_into_a_system_message_is_composed(rig):
    client, _, http, _ = rig
    m0 = http.get("/metrics").text
    _, ex, details = chat(client, [{"role": "system", "content": "You answer for a shop.\n" + SKILL + "\n\nBe brief."},
                                   {"role": "user", "content": "Is a broken cable covered?"}])
    steps = [s for s in ex["steps"] if s["source"] == "skill:pm-warranty"]
    assert steps and steps[0]["kind"] == "reposition" and steps[0]["reused"] > 0, ex["steps"]
    assert any("skill:pm-warranty at tokens" in n for n in ex["notes"])
    assert details["composed_tokens"] >= steps[0]["reused"] and split_sums(details), details
    m1 = http.get("/metrics").text
    assert metric(m1, "kvnotes_reused_tokens_total", kind="composed") - \
        metric(m0, "kvnotes_reused_tokens_total", kind="composed") == details["composed_tokens"]


def test_a_document_two_prompts_shared_is_reused_at_another_offset_by_its_tenant_only(rig):
    client, other, http, _ = rig
    d1, d2, d3, d4 = (doc(t) for t in ("pm-harbour", "pm-orchard", "pm-quarry", "pm-meadow"))
    ask = "\n\nWhich bay holds crate 3?"

    def docs(*ds):
        return [{"role": "user", "content": "Documents:\n" + "\n\n".join(ds) + ask}]
    compiled = lambda: sum(metric(http.get("/metrics").text, "kvnotes_recurring_spans_total", outcome=o)  # noqa: E731
                           for o in ("compiled", "compiled_in_request"))     # in the 2nd prompt's build, or after it
    before = compiled()
    chat(client, docs(d1, d2))
    chat(client, docs(d3, d2))
    wait_for(lambda: compiled() > before, 120, "the shared document compiled on its own")
    _, ex, details = chat(client, docs(d4, d1, d2))
    spans = [s for s in ex["steps"] if s["source"].startswith("span:")]
    assert spans and all(s["kind"] == "reposition" for s in spans), ex["steps"]
    assert details["composed_tokens"] > 0 and split_sums(details), (details, ex["notes"], [
        (s["source"], s["position"], s["tokens"], s["computed"], s["reused"]) for s in ex["steps"]])
    _, theirs, _ = chat(other, docs(d4, d1, d2))                  # another tenant: nothing of this one's
    assert not [s for s in theirs["steps"] if s["source"].startswith("span:")], theirs["steps"]


def test_a_one_field_change_of_a_held_prompt_is_planned_as_an_edit(rig):
    # a tenant of its own: its first prompt is computed by a prefill worker and stored in the tier (a
    # prompt whose leading tokens the decode engine already holds is computed there and not stored:
    # it is no held prompt to edit)
    _, _, http, client = rig
    ask = {"role": "user", "content": "What is the shipment's status?"}
    first, _, _ = chat(client, [{"role": "system", "content": record("in transit")}, ask], policy="exact")
    _, ex, details = chat(client, [{"role": "system", "content": record("delivered")}, ask])
    assert ex["kind"] == "edit_in_place", (ex["notes"], [(s["kind"], s["source"], s["tokens"]) for s in ex["steps"]])
    assert any("first divergence" in n and "message 0 (system)" in n for n in ex["notes"]), ex["notes"]
    assert details["edited_tokens"] > 0 and split_sums(details)
    assert metric(http.get("/metrics").text, "kvnotes_reused_tokens_total", kind="edited") >= details["edited_tokens"]


def test_a_document_set_reordered_across_requests_is_reused_at_other_offsets(rig, default_cluster):
    """RAG traffic: the same documents in another order in every request. Under ``fast`` (the
    default ``matching.compile_after: 1``) the first request's documents are compiled on their own
    in the background after its answer; every later request, whatever the order, splices each
    at its offset there, and ``usage`` says which tokens rest on composed KV."""
    import openai

    from cluster.control.state import open_state
    from cluster.http.auth import create_key

    cfg, _ = default_cluster
    _, _, http, _ = rig
    store = open_state(cfg.state.resolved_url)
    key, _ = create_key(store, "pm-rag-tenant")
    store.close()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1", api_key=key)
    ds = [doc(t) for t in ("pm-atlas", "pm-beacon", "pm-cinder")]

    def docs(order, ask):
        return [{"role": "user", "content": "Documents follow.\n\n" + "\n\n".join(ds[j] for j in order)
                 + f"\n\nQuestion: {ask}"}]
    # the earlier tests' background compiles (another tenant's first-sighting units, deferred while
    # requests ran) ended first: else they hold compiles_in_flight (this prompt's units skipped_busy)
    # and their 'compiled' counts pass for this prompt's
    wait_for(lambda: pending(recurring(http)) == 0, 180, "the earlier tests' background compiles ended")
    before = recurring(http)
    _, first, d0 = chat(client, docs((0, 1, 2), "Which bay holds crate 3?"))
    assert not [s for s in first["steps"] if s["source"].startswith("span:")] and d0["composed_tokens"] == 0
    assert recurring(http)["scheduled"] - before["scheduled"] >= 3     # counted before the answer's last event
    wait_for(lambda: pending(recurring(http)) == 0, 180, "the three documents compiled on their own after the answer")
    ends = {o: n - before[o] for o, n in recurring(http).items()}
    assert ends["compiled"] + ends["cached"] == ends["scheduled"] >= 3, ends       # none skipped_busy / failed
    for order, ask in (((2, 0, 1), "Which crate is in bay 5?"), ((1, 2, 0), "Name one register.")):
        _, ex, details = chat(client, docs(order, ask))
        spans = [s for s in ex["steps"] if s["source"].startswith("span:")]
        assert len(spans) == 3 and all(s["kind"] == "reposition" and s["reused"] > 0 for s in spans), (
            [(s["source"], s["position"], s["tokens"], s["reused"]) for s in ex["steps"]], ex["notes"])
        assert len({s["position"] for s in spans}) == 3                  # each at its offset in this order
        reused = sum(s["reused"] for s in spans)
        assert details["composed_tokens"] == reused and details["cached_tokens"] >= reused and split_sums(details)
        assert reused > 0.6 * ex["prompt_tokens"], (reused, ex["prompt_tokens"])
