"""Reasoning outputs through a real server (uvicorn on 127.0.0.1, the official openai client): a tiny random
Llama that can think (``<think>``/``</think>`` single ids, a Qwen3-style template that opens the thinking), served
with --reasoning-parser qwen3. A logit bias on ``</think>``, chosen from transformers' logits, closes the greedy
thinking at a known step; a constraint (regex, JSON schema, forced tool call) then holds the answer only, so the
thinking comes back as ``reasoning_content`` and the constrained answer as ``content`` or tool calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.reasoning import ReasoningOptions, family_reasoning_parser
from pagoda.registry.plugin_manager import PluginManager
from pagoda.errors import ConfigError
from reasoning_models import closing_bias, write_tiny_thinker

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
ANSWER = {"structured_outputs": {"regex": r"The answer is 4\."}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server, [(the thinking a bias on </think> closes, that logit_bias) without tools, with TOOL])."""
    model_dir = write_tiny_thinker(tmp_path_factory.mktemp("thinker"))
    engine = LLM(model=str(model_dir), dtype="float32", cpu_threads=1, max_model_len=512,
                 kv_cache_memory_bytes=8 << 20).engine
    tokenizer = engine.tokenizer
    end = tokenizer.convert_tokens_to_ids("</think>")
    drives = []
    for tools in (None, [TOOL]):  # the tools are written into the prompt: the greedy thinking differs
        prompt = tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
        bias, thinking = closing_bias(model_dir, tokenizer.encode(prompt, add_special_tokens=False), end)
        drives.append((tokenizer.decode(thinking), {str(end): bias}))
    srv = ServerThread(build_app(AsyncLLMEngine(engine), reasoning_parser="qwen3")).start()
    yield srv, drives
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thinking(served):
    return served[1][0][0]


@pytest.fixture(scope="module")
def chat(client, served):
    model = client.models.list().data[0].id

    def chat(**fields):
        extra = {**fields.pop("extra_body", {})}
        return client.chat.completions.create(**{"model": model, "messages": MESSAGES, "temperature": 0,
                                                 "max_tokens": 60,
                                                 "logit_bias": served[1]["tools" in fields][1], **fields},
                                              extra_body=extra or None)
    return chat


def test_the_thinking_is_free_and_the_regex_holds_the_answer_after_it(chat, thinking):
    resp = chat(extra_body=ANSWER)
    message = resp.choices[0].message
    assert message.reasoning_content == thinking and "The answer" not in thinking
    assert message.content == "The answer is 4."
    assert resp.choices[0].finish_reason == "stop"


def test_a_streamed_answer_sends_its_thinking_in_reasoning_content_deltas_and_adds_up_to_the_whole(chat, thinking):
    reasoning, content = [], []
    for chunk in chat(extra_body=ANSWER, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            assert "think>" not in reasoning[-1] + content[-1]
    assert "".join(reasoning) == thinking
    assert "".join(content) == "The answer is 4."


def test_a_json_schema_holds_the_answer_after_the_thinking(chat, thinking):
    resp = chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    message = resp.choices[0].message
    assert message.reasoning_content == thinking
    jsonschema.validate(json.loads(message.content), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_is_made_after_the_thinking_whole_and_streamed(chat, served, choice):
    thinking = served[1][1][0]
    message = chat(tools=[TOOL], tool_choice=choice, parallel_tool_calls=False).choices[0].message
    assert message.reasoning_content == thinking
    (call,) = message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    reasoning, arguments = [], []
    for chunk in chat(tools=[TOOL], tool_choice=choice, parallel_tool_calls=False, stream=True):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            arguments += [t.function.arguments or "" for t in c.delta.tool_calls or []]
    assert "".join(reasoning) == thinking
    assert json.loads("".join(arguments)) == json.loads(call.function.arguments)


def test_with_thinking_switched_off_the_schema_holds_the_answer_from_its_first_token(chat):
    resp = chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}}, logit_bias=None)
    message = resp.choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_an_answer_cut_off_while_thinking_is_all_thinking_and_never_constrained(chat):
    resp = chat(logit_bias=None, max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    message = resp.choices[0].message
    assert message.content is None and message.reasoning_content
    assert resp.choices[0].finish_reason == "length"


def test_the_parser_is_the_familys_where_it_is_unambiguous_and_a_wrong_name_fails_at_start_up():
    assert family_reasoning_parser({"model_type": "qwen3"}, "")[0] == "qwen3"
    assert family_reasoning_parser({"model_type": "gpt_oss"}, "")[0] == "openai_gptoss"
    assert family_reasoning_parser({"model_type": "qwen2"}, "{{ '</think>' }}")[0] == "deepseek_r1"
    assert family_reasoning_parser({"model_type": "llama"}, "<|im_start|>")[0] is None
    pm = PluginManager().load(autoload=False)
    with pytest.raises(ConfigError, match="deepseek_r1"):
        ReasoningOptions.resolve(pm, "nonesuch")
    assert ReasoningOptions.resolve(pm, "none").factory is None


def test_the_responses_api_gives_a_reasoning_item_before_the_constrained_message_whole_and_streamed(
        client, served, thinking):
    fields = dict(model=client.models.list().data[0].id, input=MESSAGES[0]["content"], temperature=0,
                  max_output_tokens=60, extra_body={**ANSWER, "logit_bias": served[1][0][1]})
    resp = client.responses.create(**fields)
    item, message = resp.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    assert item.content[0].text == thinking
    assert message.type == "message" and resp.output_text == "The answer is 4."
    deltas, done = [], {}
    for event in client.responses.create(**fields, stream=True):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.reasoning_text.done":
            done["text"] = event.text
        elif event.type == "response.completed":
            done["output"] = event.response.output
    assert "".join(deltas) == done["text"] == thinking
    assert [item.type for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][1].content[0].text == "The answer is 4."
    schema = dict(fields, extra_body={"logit_bias": served[1][0][1]},
                  text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})
    item, message = client.responses.create(**schema).output
    assert item.content[0].text == thinking
    jsonschema.validate(json.loads(message.content[0].text), SCHEMA)
