"""/v1/responses on 127.0.0.1, driven by the official ``openai`` client and by an OpenAI Agents SDK agent.

One real uvicorn server over the real default model (bf16 in the batch-invariant mode, so greedy tokens are exact
whatever else the server batches) serves the whole module; offline references come from the same engine, through the same chat template, before the server takes
it over.
"""

from __future__ import annotations


import asyncio
import json

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.generation_config import eos_token_ids
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from engine_helpers import wait_until_cache_is_free
from leaving_client import post_and_leave_while_running

API_KEY = "sk-pagoda-test"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is 2 + 2?"
STORY = "Tell me a story about a dragon."  # greedy, far longer than 12 tokens
INSTRUCTIONS = "Answer in one short sentence."
SHORT_QUESTION = "What is the capital of France?"  # with INSTRUCTIONS, greedy: one sentence of 8 tokens
TURN_1 = "My name is Ada and I like tea."
TURN_2 = "What is my name?"
LONG_TASK = "Count from 1 to 1000, separated by commas."


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True,
               cpu_threads=1, kv_cache_memory_bytes=128 << 20, max_model_len=2048)


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def offline(llm):
    """Chat results of the offline LLM, one request at a time, before the server owns the engine."""

    def chat(messages, max_tokens):
        return llm.chat(messages, greedy(max_tokens), use_tqdm=False)[0]

    turn_1 = chat([{"role": "user", "content": TURN_1}], 16)
    return {
        "story": chat([{"role": "user", "content": STORY}], 12),
        "instructed": chat([{"role": "system", "content": INSTRUCTIONS},
                            {"role": "user", "content": SHORT_QUESTION}], 24),
        "turn_1": turn_1,
        "turn_2": chat([{"role": "user", "content": TURN_1}, {"role": "assistant", "content": turn_1.outputs[0].text},
                        {"role": "user", "content": TURN_2}], 16),
    }


@pytest.fixture(scope="module")
def server(llm, offline):
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), api_key=API_KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def test_text_input_cut_by_max_output_tokens_is_an_incomplete_response_with_the_chat_greedy_text(client, offline):
    resp = client.responses.create(model=MODEL, input=STORY, max_output_tokens=12, temperature=0)
    ref = offline["story"]
    assert ref.outputs[0].finish_reason == "length"
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    [part] = item.content
    assert part.type == "output_text" and part.text == ref.outputs[0].text == resp.output_text
    assert resp.usage.input_tokens == len(ref.prompt_token_ids)
    assert resp.usage.output_tokens == 12
    assert resp.usage.total_tokens == resp.usage.input_tokens + 12
    assert resp.max_output_tokens == 12 and resp.temperature == 0 and resp.created_at > 0


def test_message_items_and_instructions_render_with_the_chat_template(client, offline):
    resp = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": SHORT_QUESTION}]}])
    ref = offline["instructed"]
    assert ref.outputs[0].finish_reason == "stop"  # the answer ends before the budget: a completed response
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text == ref.outputs[0].text and resp.instructions == INSTRUCTIONS
    assert resp.usage.input_tokens == len(ref.prompt_token_ids)
    assert resp.usage.output_tokens == len(ref.outputs[0].token_ids)


def test_streamed_events_come_in_openai_order_and_add_up_to_the_greedy_text(client, offline):
    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=SHORT_QUESTION,
                                          max_output_tokens=24, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in events[4:-4]]
    assert len(deltas) > 3 and all(e.type == "response.output_text.delta" for e in deltas)  # as produced
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = offline["instructed"].outputs[0].text
    assert "".join(e.delta for e in deltas) == events[-4].text == text
    assert events[-2].item.content[0].text == text and events[-2].item.status == "completed"
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and final.usage.output_tokens == len(
        offline["instructed"].outputs[0].token_ids)

    # the client's stream helper accumulates the same events into the same response
    with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input=SHORT_QUESTION,
                                 max_output_tokens=24, temperature=0) as stream:
        assert stream.get_final_response().output_text == text


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete_then_completed(client, offline):
    events = list(client.responses.create(model=MODEL, input=STORY, max_output_tokens=5, temperature=0,
                                          stream=True))
    # OpenAI's terminal event, then the one the SDK's stream helpers wait for, carrying the same response
    assert [e.type for e in events[-2:]] == ["response.incomplete", "response.completed"]
    assert events[-1].response == events[-2].response
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-3].item.status == "incomplete"
    assert offline["story"].outputs[0].text.startswith(events[-1].response.output_text)
    assert [e.sequence_number for e in events] == list(range(len(events)))

    # the SDK's stream helper: every event, then the final response (it raises without response.completed)
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=5, temperature=0) as stream:
        seen = [e.type for e in stream]
        final = stream.get_final_response()
    assert seen[-2:] == ["response.incomplete", "response.completed"]
    assert final.status == "incomplete" and final.output_text == events[-1].response.output_text

    async def async_helper():  # the async client's helper waits for the same event
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        async with aclient.responses.stream(model=MODEL, input=STORY, max_output_tokens=5, temperature=0) as s:
            return await s.get_final_response()

    final = asyncio.run(async_helper())
    assert final.status == "incomplete" and final.output_text == events[-1].response.output_text
    assert final.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_a_stored_conversation_until_it_is_deleted(client, offline):
    first = client.responses.create(model=MODEL, input=TURN_1, max_output_tokens=16, temperature=0)
    assert first.output_text == offline["turn_1"].outputs[0].text
    second = client.responses.create(model=MODEL, input=TURN_2, previous_response_id=first.id,
                                     max_output_tokens=16, temperature=0)
    ref = offline["turn_2"]
    assert second.previous_response_id == first.id
    assert second.output_text == ref.outputs[0].text
    assert second.usage.input_tokens == len(ref.prompt_token_ids)  # the whole conversation went in

    stored = client.responses.retrieve(second.id)
    assert stored.id == second.id and stored.output_text == second.output_text and stored.status == second.status
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(second.id)
    assert second.id in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="And then?", previous_response_id=second.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id" and "not stored" in info.value.body["message"]


def test_a_response_with_store_false_is_not_kept(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_logprobs_come_with_the_output_text_when_included(client):
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
                                   include=["message.output_text.logprobs"])
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == resp.usage.output_tokens == 4
    assert "".join(lp.token for lp in logprobs) == resp.output_text
    for lp in logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob) and lp.logprob <= 0


def test_fields_that_mean_nothing_here_are_accepted_and_named_in_a_header(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=2, metadata={"ticket": "42"}, user="u-1", truncation="auto",
        reasoning={"effort": "low"}, service_tier="auto", max_tool_calls=3, prompt_cache_key="k",
        safety_identifier="s", include=["reasoning.encrypted_content"], text={"verbosity": "low"})
    ignored = set(raw.headers["x-pagoda-ignored-fields"].split(", "))
    assert ignored == {"metadata", "user", "truncation", "reasoning", "service_tier", "max_tool_calls",
                       "prompt_cache_key", "safety_identifier", "include", "text.verbosity"}
    resp = raw.parse()
    assert resp.metadata == {"ticket": "42"} and resp.user == "u-1" and resp.truncation == "disabled"
    plain = client.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=1)
    assert "x-pagoda-ignored-fields" not in plain.headers


ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
BAD_INPUT = [
    # (id, body, param, words the message must contain)
    ("no-input", {"max_output_tokens": 2}, "input", "this field is required"),
    ("input-number", {"input": 5}, "input", "must be a string or a list of input items"),
    ("input-empty-list", {"input": []}, "input", "at least 1 item"),
    ("image-part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0", "input_image"),
    ("reasoning-item", {"input": [{"type": "reasoning", "summary": []}]}, "input.0", "'reasoning' are not served"),
    ("tool-role", {"input": [{"role": "tool", "content": "4"}]}, "input.0.role", "tool"),
    ("output-of-no-call", {"input": [{"type": "function_call_output", "call_id": "c1", "output": "4"}]},
     "input.0.call_id", "no function_call item with that call_id"),
    ("call-arguments-not-json", {"input": [{"type": "function_call", "call_id": "c1", "name": "add",
                                            "arguments": "{a: 1}"}]}, "input.0.arguments", "is not JSON"),
    ("image-output", {"input": [{"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input.0.output.0", "'input_image'"),
    ("hosted-tool", {"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0", "tools of type 'web_search'"),
    ("mcp-tool", {"input": "Hi", "tools": [ADD, {"type": "mcp", "server_label": "x"}]}, "tools.1", "'mcp'"),
    ("nested-chat-tool", {"input": "Hi", "tools": [{"type": "function", "function": {"name": "add"}}]},
     "tools.0", "the Responses API writes it flat"),
    ("hosted-tool-choice", {"input": "Hi", "tools": [ADD], "tool_choice": {"type": "file_search"}}, "tool_choice",
     "tool_choice of type 'file_search'"),
    ("chat-named-tool-choice", {"input": "Hi", "tools": [ADD], "tool_choice": {
        "type": "function", "function": {"name": "add"}}}, "tool_choice", "chat completions' shape"),
    ("tool-choice-required-without-tools", {"input": "Hi", "tool_choice": "required"}, "tool_choice",
     "tool_choice needs tools"),
    ("forced-tool-choice-and-text-format", {"input": "Hi", "tools": [ADD], "tool_choice": "required",
                                            "text": {"format": {"type": "json_object"}}},
     "tool_choice", "cannot be combined with text.format"),
    ("max-output-tokens-zero", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ("max-output-tokens-past-context", {"input": "Hi", "max_output_tokens": 10 ** 6}, "max_output_tokens",
     "lower max_output_tokens"),
    ("temperature", {"input": "Hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ("unknown-previous-response", {"input": "Hi", "previous_response_id": "resp_nope"}, "previous_response_id",
     "not stored"),
    ("background", {"input": "Hi", "background": True}, "background", "not served"),
    ("conversation", {"input": "Hi", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ("json-schema-that-is-no-schema", {"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": {"type": "no-such-type"}, "strict": True}}},
     "text.format", "schema"),
    ("json-schema-without-schema", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.json_schema.schema", "required"),
    ("unknown-model", {"input": "Hi", "model": "gpt-5"}, "model", "does not exist"),
]


@pytest.mark.parametrize("body,param,words", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_gets_a_4xx_that_names_the_field(http, body, param, words):
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_text_format_holds_the_output_to_its_json_schema(client):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Name a large city and its population.",
                                       max_output_tokens=60, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed", response.incomplete_details
    jsonschema.validate(json.loads(response.output_text), schema)


def test_tools_with_auto_need_no_server_flags_and_tool_choice_none_answers_with_text(client):
    # this server runs without tool flags: auto (the default with tools) is read by the model family's parser
    resp = client.responses.create(model=MODEL, input="Add 2 and 2", tools=[ADD], max_output_tokens=2)
    assert resp.status == "incomplete" and resp.tool_choice == "auto"
    resp = client.responses.create(model=MODEL, input="Add 2 and 2", tools=[ADD], tool_choice="none",
                                   max_output_tokens=2, temperature=0)
    assert resp.output_text and resp.tool_choice == "none" and [t.name for t in resp.tools] == ["add"]
    # auto without tools is this API's default: a text answer
    assert client.responses.create(model=MODEL, input="Hi", tool_choice="auto", max_output_tokens=2).output_text


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(server, llm):
    body = {"model": MODEL, "input": LONG_TASK, "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/responses", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(20):  # the first 4 events, then deltas
                next(lines)
            assert llm.engine.kv_manager.num_free_blocks < llm.engine.num_blocks  # it holds blocks now
    assert wait_until_cache_is_free(llm)


def test_a_non_streaming_client_that_gives_up_frees_its_kv_blocks(server, llm):
    # the end token banned: the answer would run its 1,500 tokens long after the client left
    eos = eos_token_ids(llm.engine.config.model.model, llm.get_tokenizer())[0]
    body = {"model": MODEL, "input": LONG_TASK, "max_output_tokens": 1500, "temperature": 0,
            "logit_bias": {str(eos): -100}}
    post_and_leave_while_running(llm, server.url + "/v1/responses", body,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    assert wait_until_cache_is_free(llm)


def test_an_openai_agents_sdk_agent_runs_a_turn_against_the_server(server, client):
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install -e '.[test]')")
    agents.set_tracing_disabled(True)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        try:
            model = agents.OpenAIResponsesModel(model=MODEL, openai_client=aclient)
            agent = agents.Agent(name="Assistant", instructions=INSTRUCTIONS, model=model)
            result = await agents.Runner.run(agent, SHORT_QUESTION)
            streamed = agents.Runner.run_streamed(agent, SHORT_QUESTION)
            kinds = [event.type async for event in streamed.stream_events()]
            return result, streamed, kinds
        finally:
            await aclient.close()

    result, streamed, kinds = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output.strip()
    [raw] = result.raw_responses
    stored = client.responses.retrieve(raw.response_id)  # the agent's request was stored, as OpenAI's default
    assert stored.output_text == result.final_output and stored.instructions == INSTRUCTIONS
    assert isinstance(streamed.final_output, str) and streamed.final_output.strip()
    assert "raw_response_event" in kinds


def test_an_engine_fault_mid_stream_ends_it_with_error_and_response_failed(client, llm, monkeypatch):
    executor = llm.engine.executor
    real = executor.execute
    calls = {"n": 0}

    def execute(sched):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("injected runner fault")
        return real(sched)

    monkeypatch.setattr(executor, "execute", execute)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, stream=True))
    monkeypatch.undo()
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "injected runner fault" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and "injected runner fault" in failed.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert wait_until_cache_is_free(llm)
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0).output_text
