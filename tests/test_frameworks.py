"""Four agent frameworks in their quick-start shapes against a real cluster (the embedded default,
SmolLM2, reference decode engine; ``test_frameworks_vllm`` runs them with ``decode_engine:
vllm``): instructor (JSON_SCHEMA, TOOLS, JSON), pydantic-ai (tool, native and text outputs beside
a function tool), the OpenAI Agents SDK on its Responses model (its default) and its chat model,
LangChain (``bind_tools``, every ``with_structured_output`` method, streaming). No framework
option is changed from its default except the base URL, the key and the model name; request
parameters (``max_tokens``, ``temperature``, a forced ``tool_choice``) are passed as each
framework passes them. The ``json_object`` modes let the model write any JSON (as on vLLM): there
the test asks for valid JSON whenever the model stopped within ``max_tokens``. Versions are pinned
in pyproject.toml's ``test`` extra."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ASK = "Give the city Paris and its country France."


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def endpoint(default_cluster):
    """(base URL of the OpenAI routes, API key) of the kept default cluster."""
    cfg, http = default_cluster
    return f"http://127.0.0.1:{cfg.server.port}/v1", http.headers["authorization"].split()[1]


def weather(city: str) -> str:
    """The current weather of a city."""
    return f"It is sunny and 21 C in {city}."


def _valid_json_or_cut(text: str | None, finish: str | None) -> None:
    """The json_object contract: a whole JSON value unless max_tokens cut the answer."""
    if finish != "length":
        json.loads(text or "")


# ---- instructor -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_schema_and_tool_modes(endpoint, mode):
    import instructor
    import openai
    client = instructor.from_openai(openai.OpenAI(base_url=endpoint[0], api_key=endpoint[1]),
                                    mode=getattr(instructor.Mode, mode))
    got = client.chat.completions.create(model=MODEL, response_model=City, max_tokens=96, temperature=0,
                                         messages=[{"role": "user", "content": ASK}])
    assert isinstance(got, City) and got.city and got.country


def test_instructor_json_mode(endpoint):
    import instructor
    import openai
    from instructor.core import InstructorRetryException
    client = instructor.from_openai(openai.OpenAI(base_url=endpoint[0], api_key=endpoint[1]), mode=instructor.Mode.JSON)
    try:
        got, raw = client.chat.completions.create_with_completion(
            model=MODEL, response_model=City, max_tokens=96, temperature=0, messages=[{"role": "user", "content": ASK}])
        assert isinstance(got, City)
        _valid_json_or_cut(raw.choices[0].message.content, raw.choices[0].finish_reason)
    except InstructorRetryException as exc:       # the model's JSON did not fit City: still JSON, or cut
        last = exc.last_completion.choices[0]
        _valid_json_or_cut(last.message.content, last.finish_reason)


# ---- pydantic-ai ----------------------------------------------------------------------------------
def _pydantic_agent(endpoint, output_type):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=endpoint[0], api_key=endpoint[1]))
    agent = Agent(model, output_type=output_type, instructions="Answer with the city and its country.")
    agent.tool_plain(weather)
    return agent


@pytest.mark.parametrize("kind", ["tool", "native", "text"])
def test_pydantic_ai_outputs_beside_a_function_tool(endpoint, kind):
    from pydantic_ai import NativeOutput, TextOutput, UsageLimits

    def upper(text: str) -> str:
        return text.upper()
    out = {"tool": City, "native": NativeOutput(City), "text": TextOutput(upper)}[kind]
    result = _pydantic_agent(endpoint, out).run_sync(ASK, model_settings={"max_tokens": 96, "temperature": 0},
                                                     usage_limits=UsageLimits(request_limit=6))
    if kind == "text":
        assert isinstance(result.output, str) and result.output and result.output == result.output.upper()
    else:
        assert isinstance(result.output, City) and result.output.city


# ---- OpenAI Agents SDK ----------------------------------------------------------------------------
def _agents_model(endpoint, kind: str):
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)      # traces would go to OpenAI's servers, which this machine cannot reach
    client = AsyncOpenAI(base_url=endpoint[0], api_key=endpoint[1])
    cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    return cls(model=MODEL, openai_client=client)


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_agents_sdk_tool_call_and_its_result(endpoint, kind):
    """The forced call is made with the right arguments, run, and its result sent back (the Responses
    model sends ``function_call`` + ``function_call_output`` items). SmolLM2-135M then tends to call
    the tool again rather than answer, so the run may end at ``max_turns``: the items are read from
    the result or from the error's run data. ``tool_choice="required"`` because under ``auto`` the
    135M model answers without the tool, ``parallel_tool_calls=False`` because under vLLM's array
    grammar it repeats the call to ``max_tokens`` (measured; docs/api.md, tools)."""
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.exceptions import MaxTurnsExceeded
    from agents.items import ToolCallItem, ToolCallOutputItem
    agent = Agent(name="Assistant", instructions="You answer questions about the weather.",
                  model=_agents_model(endpoint, kind), tools=[function_tool(weather)],
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                               temperature=0))
    try:
        result = Runner.run_sync(agent, "What is the weather in Tokyo?", max_turns=3)
        items = result.new_items
        assert isinstance(result.final_output, str) and result.final_output.strip()
    except MaxTurnsExceeded as exc:
        items = exc.run_data.new_items       # turns after the first were served with the result sent back
        assert sum(isinstance(i, ToolCallItem) for i in items) >= 2
    calls = [i for i in items if isinstance(i, ToolCallItem)]
    outputs = [i for i in items if isinstance(i, ToolCallOutputItem)]
    assert json.loads(calls[0].raw_item.arguments)["city"] == "Tokyo" and "sunny" in outputs[0].output


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_agents_sdk_default_settings_with_a_tool(endpoint, kind):
    """The SDK's default settings (``tool_choice`` unset: ``auto``; no ``parallel_tool_calls``)
    with a tool: the run completes with an answer. SmolLM2-135M answers in text without calling
    the tool under ``auto`` (docs/api.md, tools: the model's choice, as on vLLM); a call it makes
    must carry the city."""
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.items import ToolCallItem
    agent = Agent(name="Assistant", instructions="You answer questions about the weather.",
                  model=_agents_model(endpoint, kind), tools=[function_tool(weather)],
                  model_settings=ModelSettings(max_tokens=64, temperature=0))
    result = Runner.run_sync(agent, "What is the weather in Tokyo?", max_turns=3)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    for call in (i for i in result.new_items if isinstance(i, ToolCallItem)):
        assert json.loads(call.raw_item.arguments)["city"] == "Tokyo"


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_agents_sdk_output_type(endpoint, kind):
    from agents import Agent, ModelSettings, Runner
    agent = Agent(name="Extractor", instructions="Extract the city and its country.", output_type=City,
                  model=_agents_model(endpoint, kind), model_settings=ModelSettings(max_tokens=96, temperature=0))
    result = Runner.run_sync(agent, ASK)
    assert isinstance(result.final_output, City) and result.final_output.city


def test_agents_sdk_streams_on_the_responses_model(endpoint):
    import asyncio

    from agents import Agent, ModelSettings, Runner

    async def run():
        agent = Agent(name="Assistant", instructions="Answer in one short sentence.",
                      model=_agents_model(endpoint, "responses"), model_settings=ModelSettings(max_tokens=24, temperature=0))
        streamed = Runner.run_streamed(agent, "Name a colour.")
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return deltas, streamed.final_output
    deltas, final = asyncio.run(run())
    assert deltas and "".join(deltas) == final


# ---- LangChain ------------------------------------------------------------------------------------
def _chat_openai(endpoint, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=MODEL, base_url=endpoint[0], api_key=endpoint[1], temperature=0, **kw)


def test_langchain_bind_tools_and_streaming(endpoint):
    llm = _chat_openai(endpoint, max_tokens=64)
    msg = llm.bind_tools([weather], tool_choice="weather").invoke("What is the weather in Oslo?")
    assert [c["name"] for c in msg.tool_calls] == ["weather"] and msg.tool_calls[0]["args"].get("city")
    whole = llm.invoke("Name three colours.")
    streamed = "".join(c.content for c in llm.stream("Name three colours."))
    assert streamed == whole.content and streamed


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(endpoint, method):
    llm = _chat_openai(endpoint, max_tokens=96)
    ask = ASK if method != "json_mode" else ASK + " Answer in JSON with the keys city and country."
    out = llm.with_structured_output(City, method=method, include_raw=True).invoke(ask)
    if method == "json_mode":
        raw = out["raw"]
        _valid_json_or_cut(raw.content, raw.response_metadata.get("finish_reason"))
        return
    assert out["parsing_error"] is None and isinstance(out["parsed"], City) and out["parsed"].city
