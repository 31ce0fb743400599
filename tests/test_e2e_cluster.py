"""End to end over real HTTP against the real embedded cluster: Ray actors, Ray Serve + FastAPI
router, gRPC KV transport, LMCache tier, real SmolLM2. OpenAI routes use the official client."""
import socket

import httpx
import pytest

from tests.conftest import api_key, direct_text, http_client, metric

pytestmark = pytest.mark.slow

SKILL = ("Refund policy: customers may return unused items within 30 days of delivery for a full refund. "
         "Opened electronics can be returned within 14 days with a 15 percent restocking fee.")
MEMORY = "Customer memory: Dana Whitfield lives in Leeds and bought Kestrel headphones on March 2."
TEMPLATE = "Booking 88231 for {passenger}. Flight LX318 status: {status}. Gate {gate}. Rebook cancelled flights for free.\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(default_cluster):
    """The default cluster (tests/conftest.py, shared with test_request_pricing) with this module's
    skill, memory and template."""
    cfg, client = default_cluster
    base = f"http://127.0.0.1:{cfg.server.port}"
    assert client.get("/health").json()["status"] == "ok"
    for kind, body in (("skills", {"name": "refund", "text": SKILL}), ("memories", {"name": "dana", "text": MEMORY}),
                       ("templates", {"name": "booking", "text": TEMPLATE, "labels": {"status": "flight status"}})):
        r = client.post(f"/v1/{kind}", json=body)
        assert r.status_code == 201, r.text
    return base, client


_metric, _direct = metric, direct_text


def test_openai_completions_exact_equals_recompute_and_prefix_is_reused(cluster):
    import openai

    base, http = cluster
    client = openai.OpenAI(base_url=base + "/v1", api_key=http.headers["authorization"].split()[1])
    prompt = "The three primary colours of light are red, green and blue. " * 24 + "Name one primary colour:"
    first = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"kv_policy": "exact"})
    from tests.conftest import get_engine
    ids = get_engine("smollm2-135m").encode(prompt)
    assert first.choices[0].text == _direct(ids, 12)
    assert first.usage.prompt_tokens == len(ids)
    second = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"kv_policy": "exact", "explain": True})
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens >= 256         # the prefix came from the tier
    assert second.model_extra["kvnotes"]["plan"] == "reuse"


def test_openai_chat_streaming(cluster):
    import openai

    base, http = cluster
    client = openai.OpenAI(base_url=base + "/v1", api_key=http.headers["authorization"].split()[1])
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.prompt_tokens > 0


def test_native_plans_reposition_and_exact(cluster):
    base, http = cluster
    body = {"segments": [{"skill": "refund"}, {"memory": "dana"}, {"text": "Can Dana return the headphones?"}],
            "max_tokens": 16, "temperature": 0, "explain": True}
    fast = http.post("/v1/notes/completions", json={**body, "kv_policy": "fast"}).json()
    assert fast["plan"] == "reposition", fast
    kinds = [s["kind"] for s in fast["explain"]["steps"]]
    # the skill comes first after the chat frame: frame + skill are one exact reuse of their variant
    # compiled together (precompiled at registration); the memory after it is repositioned
    assert kinds == ["reuse", "reposition"], kinds
    head = fast["explain"]["steps"][0]
    assert "compiled together: exact" in head["reason"] and head["reused"] == head["tokens"]
    again = http.post("/v1/notes/completions", json={**body, "kv_policy": "fast"}).json()
    skill_step = again["explain"]["steps"][0]
    assert skill_step["reused"] == skill_step["tokens"] and again["text"] == fast["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 40
    exact = http.post("/v1/notes/completions", json={**body, "kv_policy": "exact"}).json()
    assert [s["kind"] for s in exact["explain"]["steps"]] == ["reuse", "recompute"], exact["explain"]
    assert exact["plan"] == "reuse" and exact["explain"]["exact"]
    from tests.conftest import get_engine
    e = get_engine("smollm2-135m")
    # the frame and the skill came from the tier (no frame token computed); the decode actor may
    # also hold them from an earlier request of this tenant (exact KV, sent once)
    frame_skill = len(e.encode(e.spec.chat_user_prefix)) + len(e.encode(SKILL.strip() + "\n\n"))
    assert exact["explain"]["reused_tokens"] == frame_skill
    assert exact["usage"]["prompt_tokens_details"]["cached_tokens"] >= frame_skill
    ids = (e.encode(e.spec.chat_user_prefix) + e.encode(SKILL.strip() + "\n\n") + e.encode(MEMORY.strip() + "\n\n")
           + e.encode("Can Dana return the headphones?" + e.spec.chat_user_suffix))
    assert exact["text"] == _direct(ids, 16)


def test_session_field_edit_becomes_erratum(cluster):
    base, http = cluster
    def turn(status):
        return http.post("/v1/notes/completions", json={
            "session": "agent-17", "kv_policy": "fast", "explain": True, "max_tokens": 16, "temperature": 0,
            "edit_strategy": "erratum",
            "segments": [{"template": "booking", "fields": {"passenger": "Omar Haddad", "status": status, "gate": "B12"}},
                         {"text": "What is the status of flight LX318? Answer in one word."}]}).json()
    t1 = turn("ON TIME")
    assert t1["plan"] == "recompute"
    t2 = turn("ON TIME")
    assert t2["plan"] == "reuse" and t2["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    t3 = turn("CANCELLED")
    assert t3["plan"] == "erratum", t3
    err = [s for s in t3["explain"]["steps"] if s["kind"] == "erratum"][0]
    assert err["edits"][0] == {"template": "booking", "field": "status", "old": "ON TIME", "new": "CANCELLED"}
    assert t3["usage"]["prompt_tokens_details"]["cached_tokens"] >= t2["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_session_field_edit_follows_the_fidelity_table(cluster):
    """Without a caller preference the planner picks what the model's fidelity table trusts
    (SmolLM2: field + top-16 recompute agreed with recompute far more often than any erratum)."""
    from kvruntime.fidelity.report import load_summary
    from cluster.control.planner import choose_edit_kind

    base, http = cluster
    want = choose_edit_kind(load_summary("smollm2-135m")).kind.value
    def turn(status):
        return http.post("/v1/notes/completions", json={
            "session": "agent-18", "kv_policy": "fast", "explain": True, "max_tokens": 16, "temperature": 0,
            "segments": [{"template": "booking", "fields": {"passenger": "Omar Haddad", "status": status, "gate": "B12"}},
                         {"text": "What is the status of flight LX318? Answer in one word."}]}).json()
    turn("ON TIME")
    t2 = turn("CANCELLED")
    assert t2["plan"] == want, t2
    step = [s for s in t2["explain"]["steps"] if s["edits"]][0]
    assert step["edits"][0]["new"] == "CANCELLED"
    assert "fidelity table" in step["reason"] or "by default" in step["reason"]


def test_native_streaming_sse(cluster):
    base, http = cluster
    with http.stream("POST", "/v1/notes/completions", json={"segments": [{"skill": "refund"}, {"text": "Summarise."}],
                                                           "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2] and '"token"' in lines[0]


def test_metrics_move(cluster):
    base, http = cluster
    before = http.get("/metrics").text
    http.post("/v1/notes/completions", json={"segments": [{"memory": "dana"}, {"skill": "refund"},   # a prefix
                                                          {"text": "Is a gift card refundable?"}],   # not yet held
                                             "max_tokens": 4, "temperature": 0, "kv_policy": "fast"})
    after = http.get("/metrics").text
    assert _metric(after, "kvnotes_ttft_seconds_count", plan="reposition") == \
        _metric(before, "kvnotes_ttft_seconds_count", plan="reposition") + 1
    assert _metric(after, "kvnotes_tier_hits_total") > _metric(before, "kvnotes_tier_hits_total")
    assert _metric(after, "kvnotes_requests_total", plan="reposition", status="ok") >= 1
    # labelled with the transport that moved the bytes (kv_transport: auto picks NIXL where it runs)
    moved = {t: _metric(after, "kvnotes_kv_transfer_bytes_total", transport=t)
             - _metric(before, "kvnotes_kv_transfer_bytes_total", transport=t) for t in ("nixl", "grpc")}
    assert sum(moved.values()) > 0 and min(moved.values()) == 0, moved
    assert _metric(after, "kvnotes_stage_seconds_count", stage="transfer") > \
        _metric(before, "kvnotes_stage_seconds_count", stage="transfer")
    assert _metric(after, "kvnotes_prompt_tokens_total", source="repositioned") > 0
    assert _metric(after, "kvnotes_rope_selftest_ok", worker="prefill-0") == 1


BAD = [
    ("POST", "/v1/notes/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/notes/completions", b"", 400, "empty request body"),
    ("POST", "/v1/notes/completions", {"segments": []}, 400, "segments"),
    ("POST", "/v1/notes/completions", {"segments": [{"skill": "nope"}, {"text": "q"}]}, 404, "unknown skill"),
    ("POST", "/v1/notes/completions", {"segments": [{"memory": "nope"}, {"text": "q"}]}, 404, "unknown memory"),
    ("POST", "/v1/notes/completions", {"segments": [{"template": "nope", "fields": {}}, {"text": "q"}]}, 404, "unknown template"),
    ("POST", "/v1/notes/completions", {"segments": [{"template": "booking", "fields": {"status": "X"}}]}, 400, "missing field"),
    ("POST", "/v1/notes/completions", {"segments": [{"template": "booking", "fields": {"passenger": "A", "status": "B", "gate": "C", "seat": "D"}}]}, 400, "has no field"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q", "skill": "refund"}]}, 400, "exactly one"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": 5}]}, 400, "non-empty string"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "kv_policy": "yolo"}, 400, "kv_policy"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "model": "gpt-9"}, 404, "not served"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "frobnicate": 1}, 400, "unknown field"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "q"}], "edit_strategy": "guess"}, 400, "edit_strategy"),
    ("POST", "/v1/notes/completions", {"segments": [{"text": "word " * 9000}]}, 400, "context window"),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": ["a", 5]}, 400, "prompt[1]"),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": [999999999]}, 400, "vocabulary"),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "hi", "n": 99}, 400, "n must be between 1 and 8"),
    ("POST", "/v1/chat/completions", {"model": "smollm2-135m", "messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("POST", "/v1/skills", {"name": "", "text": "x"}, 400, "name"),
    ("POST", "/v1/skills", {"name": "empty", "text": "  "}, 400, "non-empty"),
    ("POST", "/v1/templates", {"name": "t", "text": "no placeholders"}, 400, "placeholders"),
    ("POST", "/v1/templates", {"name": "t", "text": "{a} and {a}"}, 400, "twice"),
    ("DELETE", "/v1/skills/never-registered", None, 404, "unknown skill"),
]


@pytest.mark.parametrize("method,path,body,status,needle", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_with_a_message(cluster, method, path, body, status, needle):
    base, http = cluster
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["type"]


def test_still_healthy_after_bad_requests(cluster):
    base, http = cluster
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/notes/completions", json={"segments": [{"text": "Say yes."}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_real_prometheus_scrapes_the_router(cluster, tmp_path):
    """A real Prometheus server (Debian's) scrapes /metrics; its query API sees our series."""
    import shutil
    import subprocess
    import time
    from urllib.parse import urlparse

    exe = shutil.which("prometheus")
    assert exe, "prometheus is not installed: scripts/dev.sh test installs Debian's package"
    base, http = cluster
    target = urlparse(base).netloc
    port = _free_port()
    (tmp_path / "prom.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvnotes\n"
        f"    metrics_path: /metrics\n    static_configs:\n      - targets: ['{target}']\n")
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        http.post("/v1/notes/completions", json={"segments": [{"skill": "refund"}, {"text": "Refund?"}],
                                                 "max_tokens": 2, "temperature": 0})
        prom = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
        deadline, up, reqs = time.monotonic() + 60, [], []
        while time.monotonic() < deadline:
            try:
                up = prom.get("/api/v1/query", params={"query": 'up{job="kvnotes"}'}).json()["data"]["result"]
                reqs = prom.get("/api/v1/query", params={"query": "sum(kvnotes_requests_total)"}).json()["data"]["result"]
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if up and up[0]["value"][1] == "1" and reqs and float(reqs[0]["value"][1]) > 0:
                break
            time.sleep(1)
        assert up and up[0]["value"][1] == "1", up
        assert reqs and float(reqs[0]["value"][1]) > 0, reqs
        hist = prom.get("/api/v1/query", params={"query": "sum(kvnotes_ttft_seconds_count)"}).json()["data"]["result"]
        assert float(hist[0]["value"][1]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- one request id, from the client's header to every process's log ------------------------------

def _ray_logs_dir():
    import pathlib

    import ray
    return pathlib.Path(ray._private.worker._global_node.get_logs_dir_path())


def _lines_with(tag: str, timeout_s: float = 60.0, want: tuple[str, ...] = ()) -> dict:
    """{log file: its lines holding ``tag``} over this Ray session's logs (actors, Serve replicas),
    polled until every ``want`` substring shows up in some line (stderr reaches the files late)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for f in _ray_logs_dir().rglob("*"):
            if f.is_file() and f.suffix in (".err", ".out", ".log"):
                lines = [ln for ln in f.read_text(errors="replace").splitlines() if tag in ln]
                if lines:
                    found[f] = lines
        text = "\n".join(ln for lines in found.values() for ln in lines)
        if all(w in text for w in want) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def test_the_clients_request_id_is_the_one_id_of_the_response(cluster):
    _, http = cluster
    rid = "trace-ok.1:A_b"
    r = http.post("/v1/notes/completions", headers={"x-request-id": rid},
                  json={"segments": [{"skill": "refund"}, {"text": "How long do I have?"}], "max_tokens": 4,
                        "temperature": 0, "explain": True})
    assert r.status_code == 200, r.text
    assert r.headers.get_list("x-request-id") == [rid]
    assert r.json()["id"] == f"notes-{rid}" and r.json()["explain"]["request_id"] == rid
    r = http.post("/v1/completions", headers={"x-request-id": rid + "x"},
                  json={"model": "smollm2-135m", "prompt": "Say hi.", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["id"] == f"cmpl-{rid}x", r.text
    assert r.headers.get_list("x-request-id") == [rid + "x"]
    bad = http.post("/v1/notes/completions", headers={"x-request-id": rid + "e"}, json={"segments": []})
    assert bad.status_code == 400 and bad.json()["error"]["request_id"] == rid + "e"
    assert bad.headers.get_list("x-request-id") == [rid + "e"]


def test_a_malformed_or_missing_request_id_is_drawn_once(cluster):
    import re

    _, http = cluster
    body = {"segments": [{"text": "Hi."}], "max_tokens": 1, "temperature": 0, "explain": True}
    r = http.post("/v1/notes/completions", json=body)               # none sent: the Serve proxy's id
    assert r.status_code == 200, r.text
    [rid] = r.headers.get_list("x-request-id")
    assert r.json()["id"] == f"notes-{rid}" and r.json()["explain"]["request_id"] == rid
    r = http.post("/v1/notes/completions", json=body, headers={"x-request-id": "no spaces allowed"})
    assert r.status_code == 200, r.text
    drawn = r.json()["explain"]["request_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", drawn) and r.json()["id"] == f"notes-{drawn}"
    assert drawn in r.headers.get_list("x-request-id")             # beside the proxy's echo of what was sent


def test_one_failing_request_is_followed_by_its_id_through_router_prefill_and_decode_logs(cluster):
    """A request past its deadline while decoding: 504, and its id (the client's) on the router's
    line, the prefill actor's line for its plan and the decode actor's line for its stopped stream,
    each in its own process' log."""
    from tests.conftest import get_engine

    _, http = cluster
    rid = "follow-me-0042"
    # a skill no decode actor holds yet: its KV comes from a prefill actor (a held prefix would
    # let the decode actor compute the request alone)
    r = http.post("/v1/skills", json={"name": "counting", "text": "Counting rules: write every number in words, "
                                                                  "separated by commas, and never stop early."})
    assert r.status_code == 201, r.text
    eos = {str(t): -100 for t in get_engine("smollm2-135m").eos_ids}        # never ends by itself
    r = http.post("/v1/notes/completions", headers={"x-request-id": rid},
                  json={"segments": [{"skill": "counting"},
                                     {"text": "Count from one to one thousand in words: one, two,"}],
                        "max_tokens": 2000, "temperature": 0, "deadline_s": 8, "logit_bias": eos})
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "deadline_exceeded" and err["request_id"] == rid
    assert r.headers.get_list("x-request-id") == [rid]
    tag = f"request_id={rid}"
    router_line, prefill_line, decode_line = "deadline passed during decode", "prefill-0: plan", "decode-0: generate stopped"
    found = _lines_with(tag, want=(router_line, prefill_line, decode_line))
    files = {w: [f for f, lines in found.items() if any(w in ln for ln in lines)]
             for w in (router_line, prefill_line, decode_line)}
    assert all(len(v) == 1 for v in files.values()), (files, found)
    assert len({v[0] for v in files.values()}) == 3, files             # three processes, three logs
    other = "request_id=trace-ok.1:A_b"                                  # an earlier request's lines are its own
    assert not any(other in ln for lines in found.values() for ln in lines)
