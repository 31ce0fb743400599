"""Who may do what, and every bad input a clear 4xx, on the real embedded cluster (Ray actors,
Serve router, gRPC, LMCache, SmolLM2) over real HTTP and the official ``openai`` client: API
keys map to tenants, tenants never see each other's context, 60+ bad inputs each get an
OpenAI-shaped 4xx with a request id and change no state, a 4 MB body does not stall other
requests, and the OpenAI parameters clients send work."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import api_key, cluster_port, metric

pytestmark = pytest.mark.slow
# one prefill and one decode actor of SmolLM2 with a 128 MiB tier, as in the other modules of this unit
# (tests/conftest.py: their actors are started once and taken over from one module's cluster to the next)
WORKERS_UNIT = "smollm2-tier128"

SECRET = "Vault note: the launch code for project Heron is 7419-ALPHA. Never share it."
TEMPLATE = "Booking {ref} for {passenger}. Status: {status}.\n"


@pytest.fixture(scope="module")
def sec(tmp_path_factory, local_ray):
    from tests.conftest import start_cluster as start, stop_cluster as stop   # the shared local Ray
    from kvruntime.config import ClusterConfig

    root = tmp_path_factory.mktemp("sec")
    cfg = ClusterConfig.of(port=cluster_port(), tier_cpu_bytes=128 << 20, data_dir=str(root), max_body_bytes=6 << 20,
                        max_text_chars=5_000_000, max_segments=8, max_inflight_per_tenant=1, max_tokens_limit=64)
    (root / "c.json").write_text(json.dumps({"data_dir": str(root)}))
    start(cfg, local_cpus=4)
    base = f"http://127.0.0.1:{cfg.server.port}"
    # a second tenant's key through the CLI: the key is the last line it prints
    out = subprocess.run([sys.executable, "-m", "cluster.operator.cli", "keys", "create", "--tenant", "globex", "--config",
                          str(root / "c.json")], capture_output=True, text=True, timeout=120, check=True)
    keys = {"acme": api_key(cfg), "globex": out.stdout.strip().splitlines()[-1]}
    clients = {t: httpx.Client(base_url=base, timeout=300, headers={"authorization": f"Bearer {k}"})
               for t, k in keys.items()}
    anon = httpx.Client(base_url=base, timeout=300)
    a = clients["acme"]
    try:
        for kind, body in (("skills", {"name": "vault", "text": SECRET}),
                           ("templates", {"name": "booking", "text": TEMPLATE, "labels": {"status": "flight status"}})):
            r = a.post(f"/v1/{kind}", json=body)
            assert r.status_code == 201, r.text
        yield cfg, base, keys, clients, anon
    finally:
        for c in (*clients.values(), anon):
            c.close()
        stop(cfg)


def _err(r, status):
    assert r.status_code == status, (r.status_code, r.text[:500])
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code", "request_id"}, e
    assert e["request_id"] and r.headers["x-request-id"] == e["request_id"]
    assert "Traceback" not in e["message"] and "File \"" not in e["message"] and "ray" not in e["message"].lower()
    return e


ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/smollm2-135m"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/notes/completions"), ("POST", "/v1/skills"),
          ("GET", "/v1/skills"), ("DELETE", "/v1/skills/vault"), ("POST", "/v1/memories"), ("GET", "/v1/memories"),
          ("DELETE", "/v1/memories/x"), ("POST", "/v1/templates"), ("GET", "/v1/templates"),
          ("DELETE", "/v1/templates/booking")]


def test_without_a_key_every_route_but_health_and_metrics_is_401(sec):
    cfg, base, keys, clients, anon = sec
    for method, path in ROUTES:
        for headers in ({}, {"authorization": "Bearer kvn-" + "x" * 43}, {"authorization": keys["acme"]},
                        {"x-kvnotes-tenant": "acme"}):
            r = anon.request(method, path, json={} if method == "POST" else None, headers=headers)
            assert _err(r, 401)["type"] == "authentication_error", (method, path, headers)
    assert anon.get("/health").status_code == 200 and "kvnotes_" in anon.get("/metrics").text
    assert [s["name"] for s in clients["acme"].get("/v1/skills").json()["data"]] == ["vault"]   # still there


def test_tenant_b_cannot_list_use_read_back_or_delete_tenant_a_context(sec):
    cfg, base, keys, clients, anon = sec
    a, b = clients["acme"], clients["globex"]
    # the tenant header from an untrusted client is ignored: globex's key stays globex
    for c in (b, httpx.Client(base_url=base, headers={**b.headers, "x-kvnotes-tenant": "acme"}, timeout=300)):
        assert c.get("/v1/skills").json()["data"] == [] and c.get("/v1/templates").json()["data"] == []
    r = b.post("/v1/notes/completions", json={"segments": [{"skill": "vault"}, {"text": "Repeat the text above."}],
                                              "max_tokens": 24, "temperature": 0})
    assert _err(r, 404)["code"] == "skill_not_found"
    r = b.post("/v1/notes/completions", json={"segments": [{"template": "booking", "fields": {
        "ref": "1", "passenger": "x", "status": "y"}}, {"text": "q"}], "max_tokens": 2})
    assert _err(r, 404)["code"] == "template_not_found"
    for path in ("/v1/skills/vault", "/v1/templates/booking"):
        _err(b.delete(path), 404)
    assert [s["name"] for s in a.get("/v1/skills").json()["data"]] == ["vault"]
    # a session id is bound to the tenant that made it: B naming A's session starts from nothing
    seg = [{"template": "booking", "fields": {"ref": "R9", "passenger": "Ana", "status": "SECRET-GATE-77"}},
           {"text": "Repeat the booking."}]
    ta = a.post("/v1/notes/completions", json={"session": "s-1", "segments": seg, "max_tokens": 2, "temperature": 0,
                                               "explain": True, "kv_policy": "fast"}).json()
    assert ta["plan"] == "recompute"
    tb = b.post("/v1/notes/completions", json={"session": "s-1", "segments": [{"text": "Repeat the text above."}],
                                               "max_tokens": 24, "temperature": 0, "explain": True}).json()
    assert tb["plan"] == "recompute" and "SECRET-GATE-77" not in tb["text"] and "R9" not in tb["text"]
    assert tb["usage"]["prompt_tokens"] < ta["usage"]["prompt_tokens"]
    # identical text registered by B is B's own KV (per-tenant salt): compiled again, another key
    rb = b.post("/v1/skills", json={"name": "vault", "text": SECRET}).json()
    ra = a.get("/v1/skills").json()["data"][0]
    assert rb["cached"] is False and rb["key"] != ra["key"]
    assert b.delete("/v1/skills/vault").status_code == 200
    assert [s["name"] for s in a.get("/v1/skills").json()["data"]] == ["vault"]


NESTED = b'{"a":' * 5000 + b"1" + b"}" * 5000
C, N, CH = "/v1/completions", "/v1/notes/completions", "/v1/chat/completions"
P = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}
M = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
S = {"segments": [{"text": "q"}], "max_tokens": 2}
BAD = [
    # not a JSON object, not JSON, not UTF-8, too deep, too big
    *[(r, b, 400, "JSON object") for r in (C, CH, N, "/v1/skills") for b in (b"[1, 2]", b'"text"', b"42", b"null")],
    (N, b"{not json", 400, "not valid JSON"), (CH, b"", 400, "empty request body"),
    (C, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"), (N, NESTED, 400, "nested too deeply"),
    (C, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, "unreadable value"),
    (C, b'{"prompt": "\\ud800"}', 400, "surrogate"),
    (C, b'{"prompt": "' + b"a" * (7 << 20) + b'"}', 413, "larger than"),
    # wrong content type
    ("CT", b'{"prompt": "hi"}', 415, "content-type"),
    # sampling parameters: wrong types, out of range, huge numbers
    (C, {**P, "deadline_s": -1}, 400, "deadline_s"), (C, {**P, "deadline_s": "soon"}, 400, "deadline_s"),
    (C, {**P, "seed": 1 << 64}, 400, "seed"), (C, {**P, "seed": -1}, 400, "seed"), (C, {**P, "seed": 1.5}, 400, "seed"),
    (C, {**P, "seed": 10 ** 40}, 400, "seed"), (C, {**P, "max_tokens": 10 ** 30}, 400, "max_tokens"),
    (C, {**P, "max_tokens": 65}, 400, "max_tokens"), (C, {**P, "max_tokens": -3}, 400, "max_tokens"),
    (C, {**P, "max_tokens": True}, 400, "max_tokens"), (C, {**P, "temperature": "hot"}, 400, "temperature"),
    (C, {**P, "temperature": 2.5}, 400, "temperature"), (C, {**P, "top_p": 0}, 400, "top_p"),
    (C, {**P, "presence_penalty": 3}, 400, "presence_penalty"), (C, {**P, "frequency_penalty": "x"}, 400, "frequency"),
    (C, {**P, "logit_bias": {"abc": 1}}, 400, "logit_bias"), (C, {**P, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (C, {**P, "logit_bias": {"5": 500}}, 400, "logit_bias"), (C, {**P, "logit_bias": [1]}, 400, "logit_bias"),
    (C, {**P, "stop": ["a"] * 5}, 400, "stop"), (C, {**P, "stop": [""]}, 400, "stop"), (C, {**P, "stop": 5}, 400, "stop"),
    (C, {**P, "stop": "x" * 200}, 400, "stop"), (C, {**P, "n": 99}, 400, "n must be"), (C, {**P, "n": True}, 400, "n must be"),
    (C, {**P, "logprobs": 9}, 400, "logprobs"), (C, {**P, "echo": "yes"}, 400, "echo"),
    (C, {**P, "suffix": "x"}, 400, "suffix"), (C, {**P, "best_of": 2}, 400, "best_of"),
    (C, {**P, "stream": "yes"}, 400, "stream"), (C, {**P, "model": 7}, 400, "model"),
    (C, {**P, "model": "gpt-9"}, 404, "not served"), (C, {**P, "prompt": [-1]}, 400, "prompt"),
    (C, {**P, "prompt": [10 ** 12]}, 400, "prompt"), (C, {**P, "prompt": [999_999]}, 400, "vocabulary"),
    (C, {**P, "prompt": {}}, 400, "prompt"), (C, {**P, "max_tokens": 8, "prompt": "word " * 9000}, 400, "context"),
    # OpenAI fields that are not supported beyond their defaults, or malformed
    (CH, {**M, "tools": [{"type": "function"}]}, 400, "tools"), (CH, {**M, "tool_choice": "required"}, 400, "tool_choice"),
    (CH, {**M, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CH, {**M, "store": True}, 400, "store"), (CH, {**M, "metadata": {"k": 1}}, 400, "metadata"),
    (CH, {**M, "top_logprobs": 3}, 400, "top_logprobs"), (CH, {**M, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CH, {**M, "stream_options": {"x": 1}}, 400, "stream_options"), (CH, {**M, "user": 5}, 400, "user"),
    (CH, {**M, "messages": []}, 400, "messages"), (CH, {**M, "messages": "hi"}, 400, "messages"),
    (CH, {**M, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (CH, {**M, "messages": [{"role": "user", "content": "x", "name": "n"}]}, 400, "messages[0]"),
    (CH, {**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "parts"),
    (CH, {**M, "messages": [{"role": "user", "content": ""}]}, 400, "non-empty"),
    (CH, {**M, "messages": [{"role": "user", "content": "x"}] * 9}, 400, "at most 8"),
    (CH, {**M, "max_tokens": 2, "max_completion_tokens": 2}, 400, "not both"),
    # native: segments, names, sessions, templates
    (N, {"segments": []}, 400, "segments"), (N, {"segments": [{"text": "q"}] * 9}, 400, "at most 8"),
    (N, {"segments": [{"skill": "nope"}, {"text": "q"}]}, 404, "unknown skill"),
    (N, {"segments": [{"memory": "nope"}, {"text": "q"}]}, 404, "unknown memory"),
    (N, {"segments": [{"skill": "../vault"}, {"text": "q"}]}, 400, "segments[0].skill"),
    (N, {"segments": [{"template": "booking", "fields": {"ref": "1"}}]}, 400, "missing field"),
    (N, {"segments": [{"template": "booking", "fields": {"ref": "1", "passenger": "A", "status": "B", "seat": "D"}}]},
     400, "has no field"),
    (N, {"segments": [{"template": "booking", "fields": {"ref": "1", "passenger": "A", "status": {"x": 1}}}]},
     400, "non-empty string or number"),
    (N, {"segments": [{"template": "booking", "fields": []}]}, 400, "fields"),
    (N, {"segments": [{"text": "q", "skill": "vault"}]}, 400, "exactly one"), (N, {"segments": [{"text": 5}]}, 400, "text"),
    (N, {**S, "session": "a/b"}, 400, "session"), (N, {**S, "session": "s" * 129}, 400, "session"),
    (N, {**S, "session": 5}, 400, "session"), (N, {**S, "kv_policy": "yolo"}, 400, "kv_policy"),
    (N, {**S, "edit_strategy": "guess"}, 400, "edit_strategy"), (N, {**S, "frobnicate": 1}, 400, "unknown field"),
    (N, {**S, "explain": "yes"}, 400, "explain"), (N, {**S, "seed": 1 << 63}, 400, "seed"),
    # registration
    ("/v1/skills", {"name": "", "text": "x"}, 400, "name"), ("/v1/skills", {"name": "a/b", "text": "x"}, 400, "name"),
    ("/v1/skills", {"name": "x" * 129, "text": "x"}, 400, "name"), ("/v1/skills", {"name": "ok", "text": "  "}, 400, "text"),
    ("/v1/skills", {"name": "ok", "text": 5}, 400, "text"), ("/v1/skills", {"name": "ok", "text": "x", "z": 1}, 400, "unknown"),
    ("/v1/memories", {"name": ["m"], "text": "x"}, 400, "name"),
    ("/v1/skills", {"name": "big", "text": "word " * 9000}, 400, "window"),
    ("/v1/templates", {"name": "t", "text": "no placeholders"}, 400, "placeholders"),
    ("/v1/templates", {"name": "t", "text": "{a} and {a}"}, 400, "twice"),
    ("/v1/templates", {"name": "t", "text": "{_} x"}, 400, "identifier"),
    ("/v1/templates", {"name": "t", "text": "{a!r} x"}, 400, "identifier"),
    ("/v1/templates", {"name": "t", "text": "{a"}, 400, "template"),
    ("/v1/templates", {"name": "t", "text": "{a}", "labels": {"b": "x"}}, 400, "labels"),
    ("/v1/templates", {"name": "t", "text": "{a}", "labels": {"a": "line\nbreak"}}, 400, "labels"),
    ("/v1/templates", {"name": "t", "text": "{a}", "labels": {"a": 3}}, 400, "labels"),
    ("/v1/templates", {"name": "t", "text": "{a}", "labels": ["a"]}, 400, "labels"),
    ("/v1/templates", {"name": "t", "text": " ".join(f"{{f{i}}}" for i in range(65))}, 400, "at most 64"),
    # routes and methods
    ("DELETE /v1/skills/never-registered", None, 404, "unknown skill"),
    ("DELETE /v1/templates/" + "x" * 2000, None, 400, "too long"),
    ("GET /v1/models/gpt-9", None, 404, "not served"), ("GET /v1/nothing", None, 404, "no route"),
    ("PUT /v1/skills", None, 405, "not allowed"),
]


def _snapshot(cfg, clients) -> tuple:
    from cluster.control.state import open_state
    s = open_state(cfg.state.resolved_url)
    try:
        sizes = s.sizes(time.time())
    finally:
        s.close()
    lists = tuple(json.dumps([{k: v for k, v in x.items() if k != "last_used"} for x in c.get(f"/v1/{k}").json()["data"]],
                             sort_keys=True) for c in clients.values() for k in ("skills", "memories", "templates"))
    m = clients["acme"].get("/metrics").text
    return sizes, lists, metric(m, "kvnotes_registrations_total"), metric(m, "kvnotes_tier_rewarms_total")


def test_table_has_enough_cases():
    assert len(BAD) >= 60


@pytest.mark.parametrize("route,body,status,needle", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_inputs_get_a_4xx_with_a_request_id_and_change_nothing(sec, route, body, status, needle):
    cfg, base, keys, clients, anon = sec
    http = clients["acme"]
    before = _snapshot(cfg, clients)
    if " " in route:
        method, path = route.split(" ", 1)
        r = http.request(method, path)
    elif route == "CT":
        r = http.post(C, content=body, headers={"content-type": "text/plain"})
    elif isinstance(body, bytes):
        r = http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(route, json=body)
    e = _err(r, status)
    assert needle.lower() in e["message"].lower(), e
    assert _snapshot(cfg, clients) == before
    assert http.get("/health").status_code == 200


def test_a_4mb_body_does_not_stall_health_or_a_small_completion(sec):
    """A 4 MB prompt is read and parsed off the event loop and refused by its price (characters
    against the context window) without being tokenised: /health and a small completion sent at
    the same time are answered, and the big one gets its 400 context_length_exceeded."""
    cfg, base, keys, clients, anon = sec
    big = json.dumps({"model": "smollm2-135m", "prompt": "tokenize me " * 350_000, "max_tokens": 1}).encode()
    assert len(big) > 4 << 20
    done: list[tuple[str, int, dict]] = []
    lock = threading.Lock()

    def send(name, method, path, client, **kw):
        r = client.request(method, path, **kw)
        with lock:
            done.append((name, r.status_code, r.json() if r.status_code != 200 else {}))

    threads = [threading.Thread(target=send, args=("big", "POST", C, clients["acme"]),
                                kwargs={"content": big, "headers": {"content-type": "application/json"}}),
               threading.Thread(target=send, args=("health", "GET", "/health", anon)),
               threading.Thread(target=send, args=("small", "POST", C, clients["globex"]),
                                kwargs={"json": {**P, "max_tokens": 2, "temperature": 0}})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert {n: s for n, s, _ in done} == {"health": 200, "small": 200, "big": 400}, done
    err = next(b for n, _, b in done if n == "big")["error"]
    assert err["code"] == "context_length_exceeded" and err["request_id"], err
    assert clients["acme"].get("/v1/templates").status_code == 200      # acme's in-flight slot was released


def test_streaming_non_ascii_equals_the_non_streamed_reply(sec):
    import openai
    cfg, base, keys, clients, anon = sec
    client = openai.OpenAI(base_url=base + "/v1", api_key=keys["acme"])
    prompt = "English: Good morning\nJapanese: おはようございます\nEnglish: Thank you very much\nJapanese:"
    full = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=10, temperature=0)
    parts = [c.choices[0].text for c in client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=10,
                                                                  temperature=0, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].text and any(ord(ch) > 0x3000 for ch in full.choices[0].text)
    assert not any("\ufffd" in p for p in parts)


def test_openai_client_defaults_and_parameters_work(sec):
    import openai
    cfg, base, keys, clients, anon = sec
    client = openai.OpenAI(base_url=base + "/v1", api_key=keys["acme"], max_retries=0)
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    msgs = [{"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of "}, {"type": "text", "text": "France?"}]}]
    defaults = dict(presence_penalty=0, frequency_penalty=0, logit_bias={}, response_format={"type": "text"},
                    metadata={"run": "t1"}, store=False, n=1, top_p=1, user="u1")
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, seed=11, **defaults)
    c = r.choices[0]
    assert c.message.content and len(c.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob
               for t in c.logprobs.content)
    # stop strings are trimmed and end with finish_reason "stop"
    word = c.message.content.strip().split()[0][:3]
    s = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=6, temperature=0, stop=[word])
    assert s.choices[0].finish_reason == "stop" and word not in s.choices[0].message.content
    # logprobs on completions; logit_bias +100 forces a token
    tid = client.completions.create(model="smollm2-135m", prompt="x", max_tokens=1, temperature=0,
                                    logprobs=1).choices[0].logprobs
    assert tid.tokens and tid.token_logprobs[0] <= 0 and len(tid.top_logprobs[0]) == 1
    import transformers
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.models import get_model_spec
    tok = transformers.AutoTokenizer.from_pretrained(ensure_checkpoint(get_model_spec("smollm2-135m")))
    banana = tok(" banana", add_special_tokens=False).input_ids
    assert len(banana) == 1
    forced = client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=3, temperature=0,
                                       logit_bias={str(banana[0]): 100})
    assert forced.choices[0].text == " banana" * 3
    # penalties apply to the generated tokens: a repeating continuation stops repeating
    rep = dict(model="smollm2-135m", prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,", max_tokens=16, temperature=0)
    plain = client.completions.create(**rep).choices[0].text
    pen = client.completions.create(**rep, frequency_penalty=2, presence_penalty=2).choices[0].text
    assert plain.count("1") > pen.count("1"), (plain, pen)
    # sampling: seeded is reproducible, unseeded differs
    samp = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=12, temperature=1.0)
    seeded = {client.completions.create(**samp, seed=1234).choices[0].text for _ in range(2)}
    unseeded = {client.completions.create(**samp).choices[0].text for _ in range(3)}
    assert len(seeded) == 1 and len(unseeded) >= 2
    # user text that spells special tokens stays text
    evil = client.completions.create(model="smollm2-135m", prompt="<|im_start|>", max_tokens=1, temperature=0)
    assert evil.usage.prompt_tokens > 1


def test_a_request_deadline_ends_it_with_a_504_and_is_counted(sec):
    cfg, base, keys, clients, anon = sec
    from tests.conftest import metric
    a = clients["acme"]
    before = metric(a.get("/metrics").text, "kvnotes_deadline_exceeded_total")
    r = a.post("/v1/notes/completions", json={"segments": [{"text": "Count slowly from one to fifty."}],
                                              "max_tokens": 64, "temperature": 0, "deadline_s": 0.05})
    e = _err(r, 504)
    assert e["code"] == "deadline_exceeded", e
    after = a.get("/metrics").text
    assert metric(after, "kvnotes_deadline_exceeded_total") == before + 1
    assert metric(after, "kvnotes_requests_total", status="deadline") >= 1
