"""``/v1/responses`` end to end with the official ``openai`` client against the embedded default
(reference decode engine; ``test_e2e_vllm_responses`` runs the same tests with ``decode_engine:
vllm``): text, stored responses read and deleted, a conversation continued by
``previous_response_id`` (its prompt reused), the event stream parsed by ``responses.stream``,
function calls and their outputs, ``text.format``; vLLM's constraint semantics (no unlisted
property unless the schema allows it) and ``parallel_tool_calls``; batch prompts and ``echo`` on
``/v1/completions``."""
import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}}}   # no additionalProperties


@pytest.fixture(scope="module")
def client(default_cluster):
    import openai
    cfg, http = default_cluster
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.server.port}/v1",
                         api_key=http.headers["authorization"].split()[1], max_retries=0, timeout=600)


# long enough (> 256 tokens) that the prompt index records the first turn's prefix on either engine
RULES = "Answer in a few words. " + "You know fruit, vegetables, markets and seasons, and you answer briefly. " * 24


def test_text_stored_read_continued_and_deleted(client):
    import openai
    r = client.responses.create(model=MODEL, input="Name a fruit.", instructions=RULES, max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 12 and u.total_tokens == u.input_tokens + u.output_tokens
    assert r.instructions == RULES and r.max_output_tokens == 12
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    # the conversation goes on from the stored one: its prompt (the first turn) is reused
    r2 = client.responses.create(model=MODEL, input="And a vegetable?", previous_response_id=r.id,
                                 instructions=RULES, max_output_tokens=12, temperature=0)
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > u.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= 256, r2.usage
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert "not stored" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    # store: false keeps nothing
    r3 = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_the_stream_parses_with_responses_stream_and_matches(client):
    whole = client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=16, temperature=0,
                                    store=False)
    with client.responses.stream(model=MODEL, input="Count to five.", max_output_tokens=16, temperature=0) as s:
        kinds, deltas = [], []
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text     # stored before completed


def test_function_call_streamed_then_its_output_answered(client):
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER],
                                tool_choice=named, max_output_tokens=40, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER],
                                 tool_choice=named, max_output_tokens=40, temperature=0) as s:
        args = "".join(ev.delta for ev in s if ev.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    assert json.loads(args) == json.loads(final.output[0].arguments) == json.loads(call.arguments)
    # the call and its output go back as items; the model answers in text
    items = [{"role": "user", "content": "What is the weather in Oslo?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Rain, 8 C."}]
    a = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=20,
                                temperature=0)
    assert a.output_text and all(o.type == "message" for o in a.output)


def test_unlisted_properties_are_refused_and_parallel_calls_bounded(client):
    # no strict and no additionalProperties: as on vLLM, only the listed properties may appear
    r = client.responses.create(model=MODEL, input="Paris as JSON with every detail you know.", temperature=0,
                                max_output_tokens=80, text={"format": {"type": "json_schema", "name": "c",
                                                                        "schema": OPEN}})
    if r.status == "completed":
        assert set(json.loads(r.output_text)) <= {"city", "country"}, r.output_text
    one = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                         tools=[{"type": "function", "function": {k: WEATHER[k] for k in (
                                             "name", "description", "parameters")}}],
                                         tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1


def test_bad_responses_bodies_are_4xx_naming_the_field(client):
    import openai
    for kw, param in (({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"background": True}, "background"),
                      ({"extra_body": {"conversation": "c1"}}, "conversation")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, **kw)
        assert e.value.body["param"] == param and e.value.body["request_id"], e.value.body


def test_completions_batch_and_echo(client):
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
               for p in ("The sky is", "Water is")]
    one = [s.choices[0].text for s in singles]
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0, n=2,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["The sky is" + one[0]] * 2 + ["Water is" + one[1]] * 2
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)        # each prompt once
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)  # every choice
    streamed = {}
    for c in client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0,
                                       echo=True, stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: "The sky is" + one[0], 1: "Water is" + one[1]}
    # echo with logprobs: the prompt's log-probs first (test_e2e_echo_logprobs); its first token's null
    lp = client.completions.create(model=MODEL, prompt="x y", max_tokens=2, echo=True, logprobs=1).choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1] <= 0 and lp.tokens[:2] == ["x", " y"]
