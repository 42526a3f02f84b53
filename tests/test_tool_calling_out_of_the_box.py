"""Tool loops against the server as `pagoda serve` starts it with no tool flags: a real uvicorn server on 127.0.0.1
over the default model, driven by clients nobody here wrote (the official ``openai`` client, the OpenAI Agents
SDK's default agent, LangChain's ``bind_tools``, instructor's ``PARALLEL_TOOLS``).

SmolLM2-135M-Instruct's own chat template has no tools; the server picks the ``hermes`` parser for its ChatML
family and renders requests with tools with pagoda's ``chatml_hermes.jinja``. Each client completes a whole loop:
the model calls a tool, the tool's result goes back, the model answers with text. The tiny model rarely chooses a
tool by itself, so the first turn forces the call where the client lets it (``tool_choice`` ``required`` or a
named function, held to the calls' schema by structured outputs); instructor's ``PARALLEL_TOOLS`` always sends
``auto``, so there a ``structured_outputs`` regex holds the answer to two ``<tool_call>`` objects that the
server's parser then reads. Every later turn is ``auto``, read by the parser, as clients send it. What the tests
check is the loop and the calls' names and arguments, not the model's judgement.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Iterable

import openai
import pytest
from pydantic import BaseModel, Field

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.tools import WARNING_HEADER

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def started():
    """The default server, as `pagoda serve` builds it with no tool flags, and what it logged at start-up."""
    records = _Records()
    log = logging.getLogger("pagoda.server")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        engine = LLM(dtype="bfloat16", batch_invariant=True,
                     cpu_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=2048).engine
        app = build_app(AsyncLLMEngine(engine))
    finally:
        log.removeHandler(records)
    srv = ServerThread(app).start()
    yield srv, records.messages
    srv.stop()


@pytest.fixture(scope="module")
def server(started):
    return started[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_the_start_up_log_names_the_parser_and_the_template_it_chose(started):
    (line,) = [m for m in started[1] if m.startswith("tool calls:")]
    assert "'hermes' parser" in line and "chatml_hermes.jinja" in line and "--no-enable-auto-tool-choice" in line


def test_auto_on_chat_and_responses_needs_no_flags_and_shows_the_tools_to_the_model(client, server):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=question, tools=[WEATHER], temperature=0, max_tokens=8,
        extra_body={"return_prompt_text": True})
    assert raw.http_response.status_code == 200 and WARNING_HEADER not in raw.headers
    prompt = raw.parse().model_extra["prompt_text"]
    assert "<tools>\n" + json.dumps(WEATHER["function"]) + "\n</tools>" in prompt
    # without tools, the checkpoint's own template (its default system turn) renders the chat
    plain = client.chat.completions.create(model=MODEL, messages=question, max_tokens=1,
                                           extra_body={"return_prompt_text": True}).model_extra["prompt_text"]
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    response = client.responses.create(model=MODEL, input="What is the weather in Paris?", max_output_tokens=8,
                                       tools=[{"type": "function", **WEATHER["function"]}], temperature=0)
    assert response.tool_choice == "auto" and response.output


def test_the_openai_client_loop_goes_from_a_required_call_to_an_answer_under_auto(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=60, tool_choice="required")
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=12)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None


# ---- the OpenAI Agents SDK: its default agent, on its default (Responses) model -----------------------------


def test_an_agents_sdk_default_agent_calls_its_tool_and_answers_from_the_result(server):
    import agents
    from agents.models.openai_provider import OpenAIProvider

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return json.dumps({"city": city, "weather": "18 degrees, sunny"})

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            # a model named by a string, the provider's default client: the SDK's Responses model
            agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                                 model=MODEL, model_settings=agents.ModelSettings(tool_choice="required",
                                                                                  temperature=0, max_tokens=30))
            config = agents.RunConfig(model_provider=OpenAIProvider(openai_client=aclient), tracing_disabled=True)
            return await agents.Runner.run(agent, "What is the weather in Paris?", run_config=config, max_turns=3)
        finally:
            await aclient.close()

    result = asyncio.run(run())
    first, second = result.raw_responses  # the call, then (tool_choice reset to auto) the answer
    assert [item.type for item in first.output] == ["function_call"] and first.output[0].name == "get_weather"
    assert len(asked) == 1 and json.loads(first.output[0].arguments) == {"city": asked[0]}
    assert all(item.type == "message" for item in second.output)
    assert isinstance(result.final_output, str) and result.final_output.strip()


# ---- LangChain ----------------------------------------------------------------------------------------------


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(description="the city's name")


def test_langchain_bind_tools_loop_goes_from_the_call_to_an_answer(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=30,
                      max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    called = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke(messages)
    (call,) = called.tool_calls
    assert call["name"] == "GetWeather" and set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    messages += [called, ToolMessage(json.dumps({"weather": "18 degrees, sunny"}), tool_call_id=call["id"])]
    answer = chat.bind_tools([GetWeather]).invoke(messages)  # tool_choice auto, read by the server's parser
    assert answer.tool_calls == [] and isinstance(answer.content, str) and answer.content.strip()


# ---- instructor ---------------------------------------------------------------------------------------------


class Weather(BaseModel):
    """The weather in a city."""

    city: str
    degrees: int


def hermes_calls_regex(name: str, count: int) -> str:
    """A regex for ``count`` calls of ``name`` in the Hermes format, each with a city of the question and whole
    degrees."""
    one = ('<tool_call>\\n\\{"name": "' + name + '", "arguments": \\{"city": "(Paris|London)", '
           '"degrees": [0-9]{1,2}\\}\\}\\n</tool_call>')
    return "\\n".join([one] * count)


def test_instructor_parallel_tools_reads_two_calls_and_the_loop_ends_with_an_answer(server):
    import instructor

    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    client = instructor.from_openai(plain, mode=instructor.Mode.PARALLEL_TOOLS)
    completions: list = []
    client.on("completion:response", completions.append)
    messages = [{"role": "user", "content": "It is 18 degrees in Paris and 12 degrees in London."}]
    # PARALLEL_TOOLS sends tool_choice "auto"; the regex holds the answer to two calls in the model's tool format
    weathers = list(client.chat.completions.create(
        model=MODEL, response_model=Iterable[Weather], messages=messages, temperature=0, max_tokens=80,
        max_retries=0, extra_body={"structured_outputs": {"regex": hermes_calls_regex("Weather", 2)}}))
    (completion,) = completions
    assert len(weathers) == 2 and all(isinstance(w, Weather) and w.city for w in weathers)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [w.model_dump() for w in weathers]
    # the results go back, and the model answers under auto with the same tools
    messages += [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "noted"} for c in message.tool_calls]
    tools = [{"type": "function", "function": {"name": "Weather", "parameters": Weather.model_json_schema()}}]
    final = plain.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=12)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
