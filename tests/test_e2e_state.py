"""State that survives, on the real embedded cluster (Ray actors, Serve router replicas, LMCache
with an fs:// tier, SQLite state): router replicas are stateless, a killed replica loses nothing,
a whole-cluster restart finds registered KV in the persistent tier, exact sessions never reuse
approximate KV, and a re-registered template is used by the next turn."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import RAY_CPUS, cluster_port, direct_text, http_client, metric, wait_for

pytestmark = pytest.mark.slow

SKILL = ("Lost luggage policy: bags delayed more than 21 days count as lost. Passengers are refunded up to "
         "1,300 euros for a lost bag, and 45 euros per day for essentials while a bag is delayed.")
TEMPLATE = "Booking 4417 for {passenger}. Flight KL902 status: {status}. Gate {gate}.\n"
QUESTION = "What is the status of flight KL902? Answer in one word."


_metric, _direct = metric, direct_text


NOTE = "Baggage desk notes follow.\n"    # text before the skill: the skill is repositioned, not frame reuse


def _turn(http, session, status, policy="fast", segments_extra=(), **kw):
    r = http.post("/v1/notes/completions", json={
        "session": session, "kv_policy": policy, "explain": True, "max_tokens": 12, "temperature": 0,
        "segments": [*segments_extra,
                     {"template": "booking", "fields": {"passenger": "Ines Duarte", "status": status, "gate": "D4"}},
                     {"text": QUESTION}], **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def state_cluster(tmp_path_factory, local_ray):
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig

    root = tmp_path_factory.mktemp("kvstate")
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, router_replicas=2, data_dir=str(root / "data"),
                        tier_persist_dir=str(root / "tier"))
    start(cfg, local_cpus=4)
    http = http_client(cfg)
    try:
        yield cfg, http
    finally:
        http.close()
        stop(cfg)


def _replica_metrics(http, want: int = 2, tries: int = 60) -> dict[str, str]:
    """/metrics of every router replica (the Serve proxy picks one per request)."""
    seen: dict[str, str] = {}
    for _ in range(tries):
        r = http.get("/metrics")
        seen[r.headers["x-kvnotes-replica"]] = r.text
        if len(seen) >= want:
            break
    assert len(seen) >= want, f"saw replicas {list(seen)}"
    return seen


def test_registration_through_one_replica_is_used_through_the_other_and_counters_sum(state_cluster):
    cfg, http = state_cluster
    before = sum(_metric(t, "kvnotes_requests_total") for t in _replica_metrics(http).values())
    r = http.post("/v1/skills", json={"name": "luggage", "text": SKILL})
    assert r.status_code == 201 and not r.json()["cached"], r.text
    registered_by = r.headers["x-kvnotes-replica"]
    assert http.post("/v1/templates", json={"name": "booking", "text": TEMPLATE}).status_code == 201
    served_by, sent = set(), 0
    for _ in range(16):
        body = {"segments": [{"text": NOTE}, {"skill": "luggage"}, {"text": "How much is refunded for a lost bag?"}],
                "max_tokens": 4, "temperature": 0, "explain": True, "kv_policy": "fast"}
        resp = http.post("/v1/notes/completions", json=body)
        sent += 1
        assert resp.status_code == 200, resp.text
        assert resp.json()["plan"] == "reposition"                 # found by content from any replica
        served_by.add(resp.headers["x-kvnotes-replica"])
        if served_by - {registered_by}:
            break
    assert served_by - {registered_by}, "no request reached the other replica"
    after = _replica_metrics(http)
    # every request through _call is counted once: the two registrations (plan "none") and the completions
    assert sum(_metric(t, "kvnotes_requests_total") for t in after.values()) - before == sent + 2
    assert all(_metric(t, "kvnotes_state_entries", kind="registrations") == 1 for t in after.values())
    # what Prometheus scrapes: service discovery lists each replica's own endpoint, and their
    # counters add up to the same total (nothing depends on which replica the proxy picked)
    routers = [g["targets"][0] for g in http.get("/metrics/targets").json() if g["labels"]["kvnotes_role"] == "router"]
    assert len(set(routers)) == cfg.server.router_replicas == 2, routers
    own = sum(_metric(httpx.get(f"http://{a}/metrics", timeout=30).text, "kvnotes_requests_total") for a in routers)
    assert own == sum(_metric(t, "kvnotes_requests_total") for t in _replica_metrics(http).values())


def test_exact_session_never_reuses_approximate_kv_and_equals_recompute(state_cluster):
    cfg, http = state_cluster
    late = [{"text": NOTE}, {"skill": "luggage"}]             # not first after the frame: repositioned
    t1 = _turn(http, "mix-1", "DELAYED", policy="fast", segments_extra=late)
    assert t1["plan"] == "reposition" and not t1["explain"]["exact"]
    t2 = _turn(http, "mix-1", "DELAYED", policy="exact", segments_extra=late)
    assert t2["plan"] == "recompute", t2["explain"]
    assert any("approximate" in n for n in t2["explain"]["notes"])
    import string
    from tests.conftest import get_engine
    e = get_engine("smollm2-135m")
    values = {"passenger": "Ines Duarte", "status": "DELAYED", "gate": "D4"}
    ids = e.encode(e.spec.chat_user_prefix) + e.encode(NOTE) + e.encode(SKILL.strip() + "\n\n")
    for literal, field, _, _ in string.Formatter().parse(TEMPLATE):   # literals and values tokenized apart
        ids += e.encode(literal) if literal else []
        ids += e.encode(values[field]) if field else []
    ids += e.encode(QUESTION + e.spec.chat_user_suffix)
    assert t2["usage"]["prompt_tokens"] == len(ids)
    assert t2["text"] == _direct(ids, 12)                              # token for token a recompute
    t3 = _turn(http, "mix-1", "DELAYED", policy="exact", segments_extra=late)
    assert t3["plan"] == "reuse" and t3["explain"]["exact"]           # t2 stored an exact context
    assert t3["text"] == t2["text"]


def test_killed_router_replicas_lose_nothing(state_cluster):
    import ray

    cfg, http = state_cluster
    t1 = _turn(http, "agent-kill", "ON TIME")
    assert t1["plan"] in ("recompute", "reuse")
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if "kvnotes-router" in a["name"] and a["namespace"] == "serve"]
    assert len(replicas) == cfg.server.router_replicas, replicas
    for a in replicas:                                                # every router process dies
        ray.kill(ray.get_actor(a["name"], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:                                # Serve starts new replicas
        try:
            if http.get("/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    statuses = []
    for _ in range(6):
        statuses.append(http.get("/v1/skills").status_code)
    assert statuses == [200] * 6
    listed = http.get("/v1/skills").json()["data"]
    assert [(s["name"], s["in_tier"]) for s in listed] == [("luggage", True)]
    assert [t["name"] for t in http.get("/v1/templates").json()["data"]] == ["booking"]
    t2 = _turn(http, "agent-kill", "CANCELLED")
    assert t2["plan"] in ("erratum", "edit_in_place"), t2["explain"]  # the session survived: an edit, not a replan
    assert not any("from scratch" in n for n in t2["explain"]["notes"])


def test_a_reregistered_template_is_used_by_the_next_turn(state_cluster):
    cfg, http = state_cluster
    t1 = _turn(http, "tpl-1", "ON TIME")
    assert http.post("/v1/templates", json={"name": "booking",
                                            "text": "Ticket 4417 for {passenger}. KL902 is {status} at gate {gate}.\n"}
                     ).status_code == 201
    t2 = _turn(http, "tpl-1", "ON TIME")
    assert t2["plan"] == "recompute" and any("re-registered" in n for n in t2["explain"]["notes"])
    assert t2["usage"]["prompt_tokens"] != t1["usage"]["prompt_tokens"]
    assert http.post("/v1/templates", json={"name": "booking", "text": TEMPLATE}).status_code == 201


def _restart_router_replicas(cfg, http) -> None:
    """Every router replica killed (nothing of their processes' memory is left); back when each of
    Serve's new ones has answered."""
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if "kvnotes-router" in a["name"] and a["namespace"] == "serve"]
    assert len(replicas) == cfg.server.router_replicas, replicas
    before = {http.get("/health").headers["x-kvnotes-replica"] for _ in range(20)}
    for a in replicas:
        ray.kill(ray.get_actor(a["name"], namespace="serve"), no_restart=True)
    seen: set[str] = set()

    def up():
        try:
            r = http.get("/health", timeout=5)
        except httpx.HTTPError:
            return False
        if r.status_code == 200:
            seen.add(r.headers["x-kvnotes-replica"])
        return len(seen - before) >= cfg.server.router_replicas
    wait_for(up, 180, "every new router replica answering", every=0.2)


def _doc(topic: str) -> str:
    """A document whose content-defined spans two prompts holding it share (checked offline: the
    rolling hash finds few boundaries in some repetitive texts, whose spans then straddle documents)."""
    return "\n".join(f"{topic} entry {i}: the {topic} register puts crate {i * 7 % 31} in bay {i * 5 % 17}."
                     for i in range(14))


def test_prompt_fingerprints_survive_a_router_restart_and_stay_with_their_tenant(state_cluster):
    """A document recurring in one tenant's chat prompts (the official ``openai`` client): its first
    sighting is counted in the state store, every router replica dies, and the second sighting, on
    a new replica, finds it recurring (only the store remembers the first), so the third prompt
    reuses it at another offset; another tenant's prompt holding the same document matches none of
    it."""
    import openai
    from cluster.control.state import open_state
    from cluster.http.auth import create_key

    cfg, http = state_cluster
    store = open_state(cfg.state.resolved_url)
    mine, theirs = (create_key(store, t)[0] for t in ("st-docs-a", "st-docs-b"))
    store.close()
    base = f"http://127.0.0.1:{cfg.server.port}/v1"
    a, b = openai.OpenAI(base_url=base, api_key=mine), openai.OpenAI(base_url=base, api_key=theirs)
    d1, d2, d3, d4 = (_doc(t) for t in ("st-harbour", "st-orchard", "st-quarry", "st-meadow"))

    def chat(client, *docs):
        r = client.chat.completions.create(
            model="smollm2-135m", max_tokens=4, temperature=0, extra_body={"kv_policy": "fast", "explain": True},
            messages=[{"role": "user",
                       "content": "Documents:\n" + "\n\n".join(docs) + "\n\nWhich bay holds crate 3?"}])
        d = r.to_dict()
        return d["kvnotes"]["explain"], d["usage"]["prompt_tokens_details"]

    def compiled():            # spans compiled on their own, by the replicas now running
        return sum(_metric(t, "kvnotes_recurring_spans_total", outcome=o)
                   for t in _replica_metrics(http).values() for o in ("compiled", "compiled_in_request"))
    chat(a, d1, d2)                                                   # first sighting: counted in the store
    _restart_router_replicas(cfg, http)
    assert compiled() == 0
    ex2, _ = chat(a, d3, d2)                                          # second: d2 recurs, by the store's count
    wait_for(compiled, 120, f"the recurring document compiled on its own after the restart ({ex2['notes']})")
    ex, details = chat(a, d4, d1, d2)
    spans = [s for s in ex["steps"] if s["source"].startswith("span:")]
    assert spans and all(s["kind"] == "reposition" for s in spans), (ex["notes"], ex["steps"])
    assert details["composed_tokens"] > 0, details
    ex_b, details_b = chat(b, d4, d1, d2)                             # the same prompt, another tenant
    assert not [s for s in ex_b["steps"] if s["source"].startswith("span:")], ex_b["steps"]
    assert not any("span:" in n for n in ex_b["notes"]) and details_b["composed_tokens"] == 0, \
        (ex_b["notes"], details_b)


def test_whole_cluster_restart_finds_skills_in_the_fs_tier(state_cluster):
    from cluster.operator.launcher import start, stop

    cfg, http = state_cluster
    stop(cfg)                                                         # every process of the cluster is gone
    # Ray again with the shared Ray's CPUs (tests/conftest.py RAY_CPUS): a next module on this worker's
    # Ray that asks for them (test_faults: 5) then finds them, instead of restarting Ray
    start(cfg, local_cpus=RAY_CPUS)
    r = http.post("/v1/skills", json={"name": "luggage", "text": SKILL})
    assert r.status_code == 201 and r.json()["cached"] and r.json()["seconds"] == 0.0, r.text   # no prefill
    resp = http.post("/v1/notes/completions", json={
        "segments": [{"text": NOTE}, {"skill": "luggage"}, {"text": "How much is refunded for a lost bag?"}],
        "max_tokens": 4, "temperature": 0, "explain": True, "kv_policy": "fast"}).json()
    step = [s for s in resp["explain"]["steps"] if s["kind"] == "reposition"][0]
    assert "re-warmed" not in step["reason"] and step["reused"] > 0
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] > 40
    t = _turn(http, "agent-kill", "CANCELLED")                        # the session survived the restart too
    assert t["plan"] in ("reuse", "erratum", "edit_in_place"), t["explain"]
