"""The Responses body translated onto the chat path (no cluster): input items become chat
messages, function tools and tool choices chat ones, ``text.format`` a ``response_format``;
what this server cannot do is a 400 naming the field. Also the completions batch and ``echo``
checks and ``parallel_tool_calls`` in the chat body."""
from __future__ import annotations

import pytest

from cluster.control.errors import RequestError
from cluster.control.limits import RequestLimits
from cluster.http.responses_body import responses_request
from cluster.http.validate import openai_request

LIM = RequestLimits()
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _req(**body):
    return responses_request({"model": "m", **body}, LIM, default_max_tokens=512)


def test_a_string_input_and_instructions():
    r = _req(input="Hi there", instructions="Be brief.", temperature=0, max_output_tokens=20)
    assert r.new_messages == ({"role": "user", "content": "Hi there"},)
    assert r.instructions == "Be brief." and r.store and not r.stream and r.previous_response_id is None
    assert r.chat == {"model": "m", "temperature": 0, "max_tokens": 20}
    assert _req(input="x").chat["max_tokens"] == 512          # the server's default without max_output_tokens


def test_items_become_chat_messages_with_calls_and_results():
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                             {"type": "input_text", "text": "Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Bergen"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "6 C"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Cold.", "annotations": []}]}]
    r = _req(input=items)
    assert [m["role"] for m in r.new_messages] == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert r.new_messages[1]["content"] == "Weather in Oslo?"
    calls = r.new_messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_1", "call_2"] and calls[1]["function"]["arguments"] == '{"city":"Bergen"}'
    assert r.new_messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "6 C"}
    # the chat path accepts what the translation gives
    chat = openai_request({**r.chat, "messages": list(r.new_messages)}, LIM, model="m", vocab=100, chat=True)
    assert chat.messages[0]["role"] == "system" and chat.messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tools_tool_choice_and_text_format():
    r = _req(input="x", tools=[{"type": "function", "name": "get_weather", "description": "d", "parameters": PARAMS,
                                "strict": True}],
             tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
             text={"format": {"type": "json_schema", "name": "city", "schema": PARAMS, "strict": True}})
    assert r.chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                                 "parameters": PARAMS, "strict": True}}]
    assert r.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert r.chat["parallel_tool_calls"] is False and r.echo["parallel_tool_calls"] is False
    assert r.chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "city", "schema": PARAMS,
                                                                                "strict": True}}
    assert _req(input="x", text={"format": {"type": "json_object"}}).chat["response_format"] == {"type": "json_object"}
    assert "response_format" not in _req(input="x", text={"format": {"type": "text"}}).chat
    assert _req(input="x", include=[], truncation="disabled", reasoning=None, store=False).store is False


@pytest.mark.parametrize("body,param,needle", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]", "images"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "non-empty"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice must be"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "between 1 and"),
    ({"input": "x", "conversation": "c"}, "conversation", "unsupported field"),
    ({"input": "x", "stream": "yes"}, "stream", "true or false"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param, needle):
    with pytest.raises(RequestError) as e:
        _req(**body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_completions_take_batches_and_echo():
    r = openai_request({"prompt": ["a", [1, 2]], "echo": True, "n": 2}, LIM, model="m", vocab=100, chat=False)
    assert r.prompts == ("a", [1, 2]) and r.echo and r.n == 2
    assert openai_request({"prompt": [5, 6]}, LIM, model="m", vocab=100, chat=False).prompts == ([5, 6],)
    for prompt, param in (([["a"]], "prompt[0]"), (["a", ""], "prompt[1]"), ([], "prompt")):
        with pytest.raises(RequestError) as e:
            openai_request({"prompt": prompt}, LIM, model="m", vocab=100, chat=False)
        assert e.value.param == param, e.value.message
    with pytest.raises(RequestError) as e:
        openai_request({"prompt": ["a"] * 200, "n": 2}, LIM, model="m", vocab=100, chat=False)
    assert "choices" in e.value.message
    with pytest.raises(RequestError):
        openai_request({"prompt": "a", "parallel_tool_calls": True}, LIM, model="m", vocab=100, chat=False)
    chat = {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": False}
    assert openai_request(chat, LIM, model="m", vocab=100, chat=True).messages
