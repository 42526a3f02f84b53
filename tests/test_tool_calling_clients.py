"""Tool-calling and structured-output client libraries against a real server on 127.0.0.1: the openai client's
``chat.completions.parse`` with a pydantic function tool, LangChain's ``bind_tools`` and
``with_structured_output(method="function_calling")``, an OpenAI Agents SDK agent with one function tool, and
instructor in its TOOLS and JSON_SCHEMA modes, streamed too, and JSON mode. Each forces a call (``tool_choice``
``required`` or a named function) or a JSON answer, which structured outputs enforce: the tests run once the engine
serves them.
"""

from __future__ import annotations

import gc
import json

import openai
import pytest
from pydantic import BaseModel, Field

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from tool_calling_helpers import HERMES_TEMPLATE


MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(description="the city's name")


@pytest.fixture(scope="module")
def server():
    engine = LLM(dtype="float32", cpu_threads=1, kv_cache_memory_bytes=64 << 20, chat_template=HERMES_TEMPLATE).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine), enable_auto_tool_choice=True,
                                 tool_call_parser="hermes")).start()
    yield srv
    srv.stop()
    engine.shutdown()  # nothing the module built stays in the worker
    del engine, srv
    gc.collect()


def test_openai_parse_returns_the_arguments_as_the_pydantic_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(model=MODEL, messages=QUESTION, temperature=0, max_tokens=60,
                                               tools=[openai.pydantic_function_tool(GetWeather)],
                                               tool_choice="required")
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=60,
                      max_retries=0)
    answer = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    (call,) = answer.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    weather = chat.with_structured_output(GetWeather, method="function_calling").invoke("Weather in Paris?")
    assert isinstance(weather, GetWeather)


def test_an_agents_sdk_agent_calls_its_function_tool_and_uses_the_result(server):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return json.dumps({"city": city, "weather": "18 degrees, sunny"})

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?", run_config=RunConfig(tracing_disabled=True))
    assert len(asked) == 1 and json.loads(result.final_output) == {"city": asked[0], "weather": "18 degrees, sunny"}


# ---- instructor -------------------------------------------------------------------------------------------


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city's name")
    degrees: int = Field(description="the temperature in degrees Celsius")


def instructor_client(server, mode: str):
    import instructor

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return instructor.from_openai(client, mode=getattr(instructor.Mode, mode))


# TOOLS: a named function tool; JSON_SCHEMA: response_format json_schema; both held to the model's schema
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_pydantic_object(server, mode):
    client = instructor_client(server, mode)
    weather, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Weather, messages=[{"role": "user", "content": "It is 18 degrees in Paris."}],
        temperature=0, max_tokens=60, max_retries=1)
    assert isinstance(weather, Weather) and weather.city
    assert completion.choices[0].finish_reason == ("tool_calls" if mode == "TOOLS" else "stop")


def test_instructor_json_mode_gets_one_complete_json_object(server):
    # JSON: response_format json_object and the schema in the system message. The grammar holds the answer to a
    # JSON object, the prompt alone to the schema: SmolLM2-135M writes the schema back (instructor then fails its
    # validation), a model that follows the prompt fills it in. max_retries=0: one request (greedy, a retry would
    # write the same ~80 tokens again)
    from instructor.core import InstructorRetryException

    client = instructor_client(server, "JSON")
    try:
        weather, completion = client.chat.completions.create_with_completion(
            model=MODEL, response_model=Weather, messages=[{"role": "user", "content": "It is 18 degrees in Paris."}],
            temperature=0, max_tokens=160, max_retries=0)
        assert isinstance(weather, Weather)
    except InstructorRetryException as exc:
        completion = exc.last_completion
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_streams_partial_objects_that_end_complete(server, mode):
    client = instructor_client(server, mode)
    partials = list(client.chat.completions.create_partial(
        model=MODEL, response_model=Weather, messages=[{"role": "user", "content": "It is 18 degrees in Paris."}],
        temperature=0, max_tokens=60, max_retries=1))
    assert len(partials) > 1  # the object grows as its arguments stream
    final = Weather.model_validate(partials[-1].model_dump())
    assert final.city and isinstance(final.degrees, int)


def test_instructor_streams_an_iterable_of_objects(server):
    # 60 tokens hold two objects; the answer may be cut after them (the model goes on repeating the second)
    client = instructor_client(server, "JSON_SCHEMA")
    cities = list(client.chat.completions.create_iterable(
        model=MODEL, response_model=Weather, temperature=0, max_tokens=60, max_retries=1,
        messages=[{"role": "user", "content": "It is 18 degrees in Paris and 12 degrees in London."}]))
    assert len(cities) > 1 and all(isinstance(c, Weather) and c.city for c in cities)
