"""Tool calling on /v1/chat/completions, end to end: a real uvicorn server on 127.0.0.1 over the default model,
driven by the official ``openai`` client.

The server runs ``--enable-auto-tool-choice --tool-call-parser hermes`` with a chat template (``--chat-template``)
that shows the tools to the model and renders the history's tool calls and results in the Hermes format. The
tiny default model does not call tools of its own accord; given a conversation in which it called
``get_weather`` twice, it calls it a third time (greedy), so these tests see a real model write a real
``<tool_call>`` that the server parses into ``tool_calls``, streamed and not. What they prove: the request fields,
the template's view of tools and history, the parser on real output and OpenAI's answer shapes; not that the
model chooses tools well. A second server, on a tiny random Llama with tool calls off, answers the 400s.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from tiny_models import write_tiny_llama
from tool_calling_helpers import HERMES_TEMPLATE, TOOLS, WEATHER_TOOL

MODEL = "SmolLM2-135M-Instruct"
WEATHER = [("Paris", "18 degrees, sunny"), ("London", "12 degrees, rain")]


def weather_history(ask: str = "Berlin") -> list[dict]:
    """Two turns of get_weather calls and their results, then the same question about ``ask``."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for i, (city, weather) in enumerate(WEATHER):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return messages + [{"role": "user", "content": f"What is the weather in {ask}?"}]


PLAIN = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", cpu_threads=1, kv_cache_memory_bytes=64 << 20, chat_template=HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def offline(llm):
    """The plain question's greedy answer with the tools in the prompt, before the server owns the engine."""
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template(PLAIN, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def server(llm, offline):
    app = build_app(AsyncLLMEngine(llm.engine), enable_auto_tool_choice=True, tool_call_parser="hermes")
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """A server with tool calls off (--no-enable-auto-tool-choice), on a tiny random Llama with the default
    model's tokenizer: it answers only the requests refused before generating."""
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    engine = LLM(str(model), served_model_name=MODEL, dtype="float32", cpu_threads=1, max_model_len=1024,
                 kv_cache_memory_bytes=16 << 20, chat_template=HERMES_TEMPLATE).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine), enable_auto_tool_choice=False)).start()
    yield srv
    srv.stop()


def chat(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 40, **fields})


# ---- tool_choice none and auto ----------------------------------------------------------------------


def test_tool_choice_none_answers_with_plain_content(client, offline):
    resp = chat(client, messages=PLAIN, tools=TOOLS, tool_choice="none", max_tokens=16)
    message = resp.choices[0].message
    assert message.content == offline.outputs[0].text and message.tool_calls is None
    assert resp.choices[0].finish_reason == offline.outputs[0].finish_reason


@pytest.fixture(scope="module")
def berlin(client):
    """The answer to the third weather question, not streamed: the model calls get_weather."""
    return chat(client, messages=weather_history(), tools=TOOLS)


def test_auto_reads_the_call_the_model_writes_into_tool_calls(berlin):
    choice = berlin.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}


def test_streamed_tool_call_deltas_reassemble_into_the_calls_of_the_plain_answer(client, berlin):
    whole = berlin.choices[0].message.tool_calls
    chunks = list(chat(client, messages=weather_history(), tools=TOOLS, stream=True))
    pieces = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(not c.choices[0].delta.content for c in chunks)
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and rest  # the arguments arrive in pieces of their own
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert (first.function.name, arguments) == (whole[0].function.name, whole[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_answer_with_its_calls_and_their_results_goes_back_as_history(client, berlin):
    messages = weather_history()
    first = berlin.choices[0].message
    messages += [first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "15 degrees, cloudy"}]
    resp = chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert resp.choices[0].message.content and resp.choices[0].message.tool_calls is None


def test_history_reaches_the_template_in_hugging_faces_shape(server):
    """The template prints each call with ``tojson`` of its arguments: a dict gives the object, so the
    arguments' JSON text was decoded; the tool result is printed with the id of its call."""
    body = {"model": MODEL, "messages": weather_history()}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert 'tool\n{"tool_call_id": "call_1", "content": "12 degrees, rain"}<|im_end|>' in prompt


def test_the_tools_reach_the_template(client, server):
    resp = chat(client, messages=PLAIN, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=1)
    without = chat(client, messages=PLAIN, max_tokens=1)
    assert resp.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the tool's schema is in the prompt


# ---- required and named functions ---------------------------------------------------------------------


def test_required_with_a_tool_schema_that_does_not_compile_is_a_400_on_tool_choice(client):
    broken = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "no-such-type"}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages=weather_history(), tools=broken, tool_choice="required")
    error = caught.value.body
    assert error["param"] == "tool_choice" and "is enforced with structured outputs" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_the_model_call_a_tool_with_arguments_that_fit_its_schema(client, stream):
    import jsonschema

    fields = dict(messages=PLAIN, tools=TOOLS, tool_choice="required", max_tokens=60)
    if not stream:
        choice = chat(client, **fields).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        reason = choice.finish_reason
    else:
        chunks = list(chat(client, stream=True, **fields))
        joined: dict[int, list] = {}
        for piece in (t for c in chunks for t in (c.choices[0].delta.tool_calls or [])):
            joined.setdefault(piece.index, [piece.function.name, ""])[1] += piece.function.arguments or ""
        calls = [tuple(joined[i]) for i in sorted(joined)]
        reason = chunks[-1].choices[0].finish_reason
    assert calls and reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_named_function_is_the_one_called(client):
    resp = chat(client, messages=PLAIN, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                max_tokens=60)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


# ---- refused requests -----------------------------------------------------------------------------


def refusal(server, **fields) -> dict:
    resp = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **fields},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_auto_with_tool_calls_turned_off_is_a_400_naming_the_flags(plain_server):
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        error = refusal(plain_server, messages=PLAIN, **fields)
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice --tool-call-parser NAME" in error["message"] and "hermes" in error["message"]
        assert "--no-enable-auto-tool-choice" in error["message"]


@pytest.mark.parametrize("fields, param, says", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice",
     "'search', which is not in tools"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "none"}, "tools", "more than one function named"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name",
     "should match pattern"),
    ({"tools": TOOLS, "tool_choice": "none", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "add", "arguments": "{a: 1}"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "is not JSON"),
    ({"tools": TOOLS, "tool_choice": "none", "messages": [{"role": "tool", "content": "18 degrees"}]},
     "messages[0].tool_call_id", "without tool_call_id"),
])
def test_a_request_with_wrong_tool_fields_is_a_400_saying_what_is_wrong(plain_server, fields, param, says):
    error = refusal(plain_server, **{"messages": PLAIN, **fields})
    assert error["param"] == param and says in error["message"], error
