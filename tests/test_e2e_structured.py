"""Structured outputs and tool calls end to end with the official ``openai`` client against the real
embedded cluster (reference decode engine; ``test_e2e_vllm_structured`` runs the same tests with
``decode_engine: vllm``): answers validate against their schemas, forced calls carry arguments
that match the function's parameters, a two-turn tool conversation works, streamed deltas add
up to the same answer, bad schemas and unknown tools are 4xx with a message."""
import json

import jsonschema
import pytest

from tests.conftest import metric

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
                                         "capital": {"type": "boolean"}},
        "required": ["city", "country", "population_millions", "capital"], "additionalProperties": False}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
# long descriptions: the tools block passes one 256-token prompt-index block, so its KV is reused
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": WEATHER_PARAMS,
    "description": "Current weather for a city: temperature, wind, rain and the sky. " * 6}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                                           "required": ["zone"]},
        "description": "The current local time in an IANA time zone such as Europe/Paris or Asia/Tokyo. " * 6}}]


@pytest.fixture(scope="module")
def client(default_cluster):
    """The kept default cluster (tests/conftest.py; reference decode): its config is this module's."""
    import openai

    cfg, http = default_cluster
    return (openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1", api_key=http.headers["authorization"].split()[1],
                          max_retries=0, timeout=600), http)


def _schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def _stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for c in stream:
        for ch in c.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def test_json_schema_answers_validate_and_stream_the_same(client):
    oa, http = client
    before = metric(http.get("/metrics").text, "kvnotes_constrained_requests_total", kind="json_schema")
    msgs = [{"role": "user", "content": "Describe Paris as JSON: city, country, population in millions, capital."}]
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                   response_format=_schema_format(CITY))
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    text, finish = _stream_text(oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                                           response_format=_schema_format(CITY), stream=True))
    assert (text, finish) == (r.choices[0].message.content, "stop")
    # sampled too, and through /v1/completions
    sampled = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0.9, seed=3,
                                         response_format=_schema_format(CITY))
    jsonschema.validate(json.loads(sampled.choices[0].message.content), CITY)
    c = oa.completions.create(model=MODEL, prompt="Paris facts in JSON:", max_tokens=80, temperature=0,
                              extra_body={"response_format": _schema_format(CITY)})
    jsonschema.validate(json.loads(c.choices[0].text), CITY)
    after = metric(http.get("/metrics").text, "kvnotes_constrained_requests_total", kind="json_schema")
    assert after - before == 4


def test_json_object_native_endpoint_and_a_cut_answer(client):
    oa, http = client
    r = http.post("/v1/notes/completions", json={"segments": [{"text": "Give a JSON object about Rome."}],
                                                 "max_tokens": 80, "temperature": 0,
                                                 "response_format": {"type": "json_object"}}).json()
    if r["finish_reason"] == "stop":
        assert isinstance(json.loads(r["text"]), dict), r
    assert r["text"].lstrip().startswith("{"), r
    cut = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON about Rome"}],
                                     max_tokens=4, temperature=0, response_format=_schema_format(CITY))
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")


def test_named_tool_call_then_the_answer_with_its_result(client):
    oa, http = client
    msgs = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "What is the weather in Oslo, in celsius?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=forced, max_tokens=60,
                                   temperature=0, extra_body={"explain": True})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert r.model_extra["kvnotes"]["explain"]["structured"]["tool_choice"] == "function"
    # streamed: the deltas add up to the same call
    name, args, finish = None, "", None
    for c in oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=forced, max_tokens=60,
                                        temperature=0, stream=True):
        for d in c.choices:
            for tc in d.delta.tool_calls or ():
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = d.finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", json.loads(call.function.arguments), "tool_calls")
    # turn 2: the call and its result go back; the model answers in text (tools still declared)
    turn2 = msgs + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12, "sky": "rain"}'}]
    a = oa.chat.completions.create(model=MODEL, messages=turn2, tools=TOOLS, tool_choice="none", max_tokens=24,
                                   temperature=0)
    assert a.choices[0].message.content and not a.choices[0].message.tool_calls
    assert a.choices[0].finish_reason in ("stop", "length")
    # the tools block is a stable prefix: the second turn found its KV in the prompt index
    assert a.usage.prompt_tokens_details.cached_tokens >= 256, a.usage


def test_required_and_auto(client):
    oa, _ = client
    msgs = [{"role": "user", "content": "What time is it in Tokyo?"}]
    r = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=60,
                                   temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls           # parallel_tool_calls false: exactly one
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    several = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=0)     # the default: one or more calls
    assert several.choices[0].finish_reason in ("tool_calls", "length")
    for c in several.choices[0].message.tool_calls if several.choices[0].finish_reason == "tool_calls" else ():
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), schema)
    auto = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40, temperature=0)
    ch = auto.choices[0]
    # free text or a parsed call, never both a call and a "tool_calls" finish without one
    assert (ch.finish_reason == "tool_calls") == bool(ch.message.tool_calls)
    streamed, finish = _stream_text(oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40,
                                                               temperature=0, stream=True))
    if not ch.message.tool_calls:
        assert (streamed, finish) == (ch.message.content, ch.finish_reason)


def test_n_choices(client):
    oa, _ = client
    msgs = [{"role": "user", "content": "Name a colour."}]
    one = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=11)
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=11, n=3,
                                   logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.choices[0].message.content == one.choices[0].message.content       # choice 0 keeps the seed
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices) >= 3   # every choice counted
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    texts = {}
    for c in oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=11, n=3,
                                        stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]


@pytest.mark.parametrize("kw,status,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400,
     "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "pattern": "(?<=a)b"}}}}, 400,
     "cannot be enforced"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, 400,
     "not among the tools"),
    ({"n": 99}, 400, "n must be between 1 and"),
])
def test_bad_structured_requests_are_4xx_with_a_message(client, kw, status, needle):
    import openai
    oa, http = client
    before = metric(http.get("/metrics").text, "kvnotes_schemas_rejected_total")
    with pytest.raises(openai.APIStatusError) as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)
    assert e.value.status_code == status and needle in e.value.message, e.value.message
    assert e.value.body.get("request_id") or e.value.response.json()["error"]["request_id"]
    rejected = metric(http.get("/metrics").text, "kvnotes_schemas_rejected_total") - before
    assert rejected == (1 if "schema" in needle or "enforced" in needle else 0)


def test_decode_worker_exports_grammar_compiles_and_cache_hits(client):
    """Reference engine only (vLLM compiles and caches grammars itself): the decode actor's own
    endpoint, found through /metrics/targets, counts compiles and cache hits."""
    import httpx
    oa, http = client
    msgs = [{"role": "user", "content": "Paris as JSON"}]
    for _ in range(2):       # the second compile of the same schema is a cache hit
        oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                   response_format=_schema_format({"type": "object", "properties": {
                                       "tag": {"enum": ["grammar-cache-probe"]}}, "required": ["tag"]}))
    decode = [g["targets"][0] for g in http.get("/metrics/targets").json() if g["labels"]["kvnotes_role"] == "decode"]
    own = httpx.get(f"http://{decode[0]}/metrics", timeout=30).text
    assert metric(own, "kvnotes_grammar_cache_total", result="hit") >= 1
    assert metric(own, "kvnotes_grammar_compile_seconds_count", kind="json_schema") >= 1
