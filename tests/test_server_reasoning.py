"""Reasoning outputs through a real server (uvicorn on 127.0.0.1, the official openai client): the default model,
on dummy weights and started with --reasoning-parser deepseek_r1, is held by a structured-output regex to write ``<think>…</think>``
and then an answer, so its thinking must come back as ``reasoning_content``, whole and streamed."""

from __future__ import annotations

import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.reasoning import ReasoningOptions, family_reasoning_parser
from pagoda.registry.plugin_manager import PluginManager
from pagoda.errors import ConfigError

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# the thinking, then the answer: the regex holds the whole output, so the model must write the tags
FORCED = {"structured_outputs": {"regex": r"<think>[a-z]{2,6}</think>\n\nThe answer is 4\."}}


@pytest.fixture(scope="module")
def server():
    engine = LLM(load_format="dummy", dtype="float32", cpu_threads=1, max_model_len=1024, kv_cache_memory_bytes=32 << 20).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine), reasoning_parser="deepseek_r1")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **fields):
    return client.chat.completions.create(**{"model": "SmolLM2-135M-Instruct", "messages": MESSAGES,
                                             "temperature": 0, "max_tokens": 40, **fields})


def test_the_thinking_comes_back_as_reasoning_content_and_the_answer_as_content(client):
    resp = chat(client, extra_body=FORCED)
    message = resp.choices[0].message
    assert message.content == "The answer is 4."
    assert message.reasoning_content.isalpha() and 2 <= len(message.reasoning_content) <= 6
    assert resp.choices[0].finish_reason == "stop"


def test_a_streamed_answer_sends_its_thinking_in_reasoning_content_deltas_and_adds_up_to_the_whole(client):
    whole = chat(client, extra_body=FORCED).choices[0].message
    reasoning, content = [], []
    for chunk in chat(client, extra_body=FORCED, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            assert "think>" not in reasoning[-1] + content[-1]
    assert "".join(reasoning) == whole.reasoning_content
    assert "".join(content) == whole.content
    assert sum(1 for piece in reasoning if piece) >= 1


def test_an_answer_without_thinking_is_all_thinking_for_deepseek_r1_whose_template_opens_it(client):
    resp = chat(client, extra_body={"structured_outputs": {"regex": "[a-z]{3}"}})
    message = resp.choices[0].message
    assert message.content is None and len(message.reasoning_content) == 3


def test_a_json_schema_or_a_forced_tool_call_is_refused_while_the_model_may_think(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, response_format={"type": "json_schema",
                                      "json_schema": {"name": "a", "schema": {"type": "object"}}})
    assert "thinking" in err.value.message and err.value.body["param"] == "response_format.json_schema.schema"
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, tools=[tool], tool_choice="required")
    assert err.value.body["param"] == "tool_choice"


def test_the_parser_is_the_familys_where_it_is_unambiguous_and_a_wrong_name_fails_at_start_up():
    assert family_reasoning_parser({"model_type": "qwen3"}, "")[0] == "qwen3"
    assert family_reasoning_parser({"model_type": "gpt_oss"}, "")[0] == "openai_gptoss"
    assert family_reasoning_parser({"model_type": "qwen2"}, "{{ '</think>' }}")[0] == "deepseek_r1"
    assert family_reasoning_parser({"model_type": "llama"}, "<|im_start|>")[0] is None
    pm = PluginManager().load(autoload=False)
    with pytest.raises(ConfigError, match="deepseek_r1"):
        ReasoningOptions.resolve(pm, "nonesuch")
    assert ReasoningOptions.resolve(pm, "none").factory is None


def test_the_responses_api_gives_a_reasoning_item_before_the_message_whole_and_streamed(client):
    fields = dict(model="SmolLM2-135M-Instruct", input="What is 2 + 2?", temperature=0, max_output_tokens=40,
                  extra_body=FORCED)
    resp = client.responses.create(**fields)
    thinking, message = resp.output
    assert thinking.type == "reasoning" and thinking.content[0].type == "reasoning_text"
    assert thinking.content[0].text.isalpha() and 2 <= len(thinking.content[0].text) <= 6
    assert message.type == "message" and resp.output_text == "The answer is 4."
    deltas, done = [], {}
    for event in client.responses.create(**fields, stream=True):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.reasoning_text.done":
            done["text"] = event.text
        elif event.type == "response.completed":
            done["output"] = event.response.output
    assert "".join(deltas) == done["text"] == thinking.content[0].text
    assert [item.type for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][1].content[0].text == "The answer is 4."
