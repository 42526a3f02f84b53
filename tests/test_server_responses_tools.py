"""Function tools on /v1/responses, end to end: a real uvicorn server on 127.0.0.1 over the default model, driven
by the official ``openai`` client and by an OpenAI Agents SDK agent on its default Responses model.

The server runs ``--enable-auto-tool-choice --tool-call-parser hermes`` with the Hermes-format chat template of
the chat tool-calling tests, which shows the tools to the model and renders the history's calls and results.
``tool_choice`` ``required`` and named functions hold the answer to the calls' schema (structured outputs), so
the tiny model's calls are valid and, greedy, the same every time; with ``auto`` the model writes a real
``<tool_call>`` when a conversation of earlier calls leads it to. Where the Responses API and chat completions
carry the same conversation, the server renders the same prompt for both (equal token counts, equal greedy
answers): the function_call and function_call_output items reach the template as chat's tool calls and tool
messages.
"""

from __future__ import annotations

import asyncio
import gc
import json

import jsonschema
import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from tool_calling_helpers import ADD_TOOL, HERMES_TEMPLATE, WEATHER_TOOL

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the weather in Paris?"
# the Responses API's flat function tools, and chat's nested ones
TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER_TOOL, ADD_TOOL)]
CHAT_TOOLS = [WEATHER_TOOL, ADD_TOOL]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
WEATHER = [("Paris", "18 degrees, sunny"), ("London", "12 degrees, rain")]
NAMED = {"type": "function", "name": "get_weather"}


def weather_items(ask: str = "Berlin") -> list[dict]:
    """Two turns of get_weather calls and their results as input items, then the same question about ``ask``
    (the conversation of the chat tool-calling tests)."""
    items: list[dict] = []
    for i, (city, weather) in enumerate(WEATHER):
        items += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": city})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": weather},
                  {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return items + [{"role": "user", "content": f"What is the weather in {ask}?"}]


def weather_messages(ask: str = "Berlin") -> list[dict]:
    """The same conversation as chat messages."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, (city, weather) in enumerate(WEATHER):
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": f"call_{i}", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": weather},
                     {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return messages + [{"role": "user", "content": f"What is the weather in {ask}?"}]


@pytest.fixture(scope="module")
def server():
    engine = LLM(dtype="float32", cpu_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=2048,
                 chat_template=HERMES_TEMPLATE).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine), enable_auto_tool_choice=True,
                                 tool_call_parser="hermes")).start()
    yield srv
    srv.stop()
    engine.shutdown()  # nothing the module built stays in the worker
    del engine, srv
    gc.collect()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def respond(client, **fields):
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 60, **fields})


def calls_of(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


def check_call_item(item) -> None:
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


# ---- the answer's items -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def named(client):
    """A whole answer with tool_choice naming get_weather."""
    return respond(client, input=QUESTION, instructions=SYSTEM, tools=TOOLS, tool_choice=NAMED)


def test_a_named_function_is_called_as_one_function_call_item(named):
    assert named.status == "completed"
    [item] = named.output  # held to the call's schema: no text beside it
    check_call_item(item)
    assert item.name == "get_weather" and named.output_text == ""
    assert named.tool_choice.type == "function" and named.tool_choice.name == "get_weather"
    assert [t.name for t in named.tools] == ["get_weather", "add"] and named.tools[0].parameters == SCHEMAS[
        "get_weather"]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_tools_with_arguments_that_fit_their_schemas(client, parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    resp = respond(client, input="What is 2 + 2?", tools=TOOLS, tool_choice="required", **fields)
    assert resp.status == "completed" and resp.output and resp.parallel_tool_calls is (parallel is not False)
    for item in resp.output:
        check_call_item(item)
    if parallel is False:
        assert len(resp.output) == 1


def test_tool_choice_none_answers_with_text_and_the_tools_still_reach_the_template(client):
    resp = respond(client, input=QUESTION, tools=TOOLS, tool_choice="none", max_output_tokens=16)
    without = respond(client, input=QUESTION, max_output_tokens=1)
    assert [item.type for item in resp.output] == ["message"] and resp.output_text
    assert resp.usage.input_tokens > without.usage.input_tokens + 20  # the tools' schemas are in the prompt


@pytest.fixture(scope="module")
def berlin(client):
    """tool_choice auto (the default with tools) over the weather conversation: the model calls get_weather."""
    return respond(client, input=weather_items(), instructions=SYSTEM, tools=TOOLS)


def test_auto_reads_the_call_the_model_writes_into_a_function_call_item(client, berlin):
    [item] = berlin.output
    check_call_item(item)
    assert (item.name, json.loads(item.arguments)) == ("get_weather", {"city": "Berlin"})
    # the items reached the template as chat's tool calls and tool messages: the same prompt, the same call
    chat = client.chat.completions.create(model=MODEL, messages=weather_messages(), tools=CHAT_TOOLS,
                                          temperature=0, max_tokens=60)
    assert berlin.usage.input_tokens == chat.usage.prompt_tokens
    [chat_call] = chat.choices[0].message.tool_calls
    assert (chat_call.function.name, chat_call.function.arguments) == (item.name, item.arguments)


# ---- streaming ----------------------------------------------------------------------------------------


def reassembled(events) -> list[dict]:
    """The output items the events add up to, checking their order on the way: each item's events between its
    added and its done, under its own output_index and id."""
    items: list[dict] = []
    open_item = None
    for e in events:
        if e.type == "response.output_item.added":
            assert open_item is None and e.output_index == len(items)
            open_item = e.item.to_dict()
            assert open_item["status"] == "in_progress"
            items.append(open_item)
        elif e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert e.item_id == open_item["id"] and e.output_index == len(items) - 1
            if e.type == "response.output_text.delta":
                open_item["content"][0]["text"] += e.delta
            else:
                open_item["arguments"] += e.delta
        elif e.type == "response.content_part.added":
            open_item["content"].append(e.part.to_dict())
        elif e.type == "response.function_call_arguments.done":
            assert e.item_id == open_item["id"] and e.arguments == open_item["arguments"]
        elif e.type == "response.output_text.done":
            assert e.item_id == open_item["id"] and e.text == open_item["content"][0]["text"]
        elif e.type == "response.output_item.done":
            done = e.item.to_dict()
            assert e.output_index == len(items) - 1 and done["status"] == "completed"
            assert {**done, "status": None} == {**open_item, "status": None}  # the pieces added up to it
            items[-1], open_item = done, None
    assert open_item is None
    return items


def without_ids(items: list[dict]) -> list[dict]:
    """What two answers' items share when their tokens are the same (the ids are new in each)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id", "status", "parsed_arguments")}
            for item in items]


@pytest.mark.parametrize("case", ["named", "auto"])
def test_streamed_events_reassemble_into_the_items_of_the_whole_answer(client, named, berlin, case):
    fields = dict(input=QUESTION, instructions=SYSTEM, tools=TOOLS, tool_choice=NAMED) if case == "named" else \
        dict(input=weather_items(), instructions=SYSTEM, tools=TOOLS)
    whole = named if case == "named" else berlin
    # the client's stream helper: the server's events as they come, then the items it accumulated from them
    with client.responses.stream(model=MODEL, temperature=0, max_output_tokens=60, **fields) as stream:
        events = list(stream)
        helped = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.count("response.function_call_arguments.delta") > 1  # the arguments arrive as generated
    items = reassembled(events)
    final = events[-1].response  # as the helper parsed it: with parsed_arguments, which the server does not send
    assert [{k: v for k, v in item.to_dict().items() if k != "parsed_arguments"} for item in final.output] == items
    expected = [item.to_dict() for item in whole.output]
    assert without_ids(items) == without_ids(expected)
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the helper added the events up to the same items (adding parsed_arguments)
    assert without_ids([item.to_dict() for item in helped.output]) == without_ids(expected)


# ---- the conversation goes on ------------------------------------------------------------------------


def test_a_function_call_output_answers_the_call_in_the_next_turn_as_chat_would(client, named):
    [call] = named.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    stateless = respond(client, instructions=SYSTEM, tools=TOOLS, tool_choice="none", max_output_tokens=16,
                        input=[{"role": "user", "content": QUESTION}, call.to_dict(), result])
    chained = respond(client, instructions=SYSTEM, tools=TOOLS, tool_choice="none", max_output_tokens=16,
                      input=[result], previous_response_id=named.id)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16, tools=CHAT_TOOLS, tool_choice="none",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}])
    assert stateless.output_text and [item.type for item in stateless.output] == ["message"]
    assert stateless.usage.input_tokens == chained.usage.input_tokens == chat.usage.prompt_tokens
    assert stateless.output_text == chained.output_text == chat.choices[0].message.content
    assert chained.previous_response_id == named.id


def test_wrong_tool_items_are_400s_naming_the_item(client):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, input=[{"type": "function_call_output", "call_id": "call_nope", "output": "4"}])
    assert caught.value.body["param"] == "input.0.call_id" and "no function_call" in caught.value.body["message"]
    bad_call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{a: 1}"}
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, input=[{"role": "user", "content": "Add"}, bad_call])
    assert caught.value.body["param"] == "input.1.arguments" and "is not JSON" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "search"})
    assert caught.value.body["param"] == "tool_choice" and "'search', which is not in tools" in (
        caught.value.body["message"])


# ---- the OpenAI Agents SDK ----------------------------------------------------------------------------


def test_an_agents_sdk_agent_runs_its_function_tool_and_answers_on_the_responses_api(server):
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install -e '.[test]')")
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
            model = agents.OpenAIResponsesModel(model=MODEL, openai_client=aclient)
            settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
            # the tool's result is the final output: one model call
            stops = agents.Agent(name="weather", instructions=SYSTEM, tools=[get_weather], model=model,
                                 model_settings=settings, tool_use_behavior="stop_on_first_tool")
            stopped = await agents.Runner.run(stops, QUESTION)
            # the model answers from the tool's result: after the call, the agent resets tool_choice (to auto,
            # read by the server's parser), so the second model call can answer with text
            answers = stops.clone(tool_use_behavior="run_llm_again", model_settings=settings.resolve(
                agents.ModelSettings(tool_choice="get_weather")))
            answered = await agents.Runner.run(answers, QUESTION, max_turns=3)
            return stopped, answered
        finally:
            await aclient.close()

    stopped, answered = asyncio.run(run())
    assert len(asked) == 2
    assert json.loads(stopped.final_output) == {"city": asked[0], "weather": "18 degrees, sunny"}
    assert isinstance(answered.final_output, str) and answered.final_output.strip()
    first, second = answered.raw_responses
    assert [item.type for item in first.output] == ["function_call"] and first.output[0].name == "get_weather"
    assert all(item.type == "message" for item in second.output)
