"""The server's tool-calling rules (pagoda.plugins.entrypoints.server.tools) on their own: the JSON schema a forced
tool choice holds an answer to, checked with jsonschema; a forced answer read back into tool calls; the request
checks; the history's tool fields as chat templates take them."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.plugins.entrypoints.server.tools import (ToolCallingOptions, forced_tool_calls, plan_tools,
                                                     template_tool_fields, tool_choice_schema)
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling_params import SamplingParams
from tool_calling_helpers import ADD_TOOL, TOOLS, WEATHER_TOOL


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    """A pydantic model's schema refers to its nested models through ``$defs``."""

    name: str
    home: Address
    past: list[Address] = []


PERSON_TOOL = {"type": "function", "function": {"name": "save_person", "parameters": Person.model_json_schema()}}


def call(function_name, **arguments):
    return {"name": function_name, "arguments": arguments}


def valid(schema, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_a_named_function_schema_fixes_the_name_and_holds_the_arguments_to_its_parameters():
    schema = tool_choice_schema(TOOLS, "get_weather")
    assert valid(schema, call("get_weather", city="Paris"))
    assert not valid(schema, call("add", a=1, b=2))  # another tool
    assert not valid(schema, call("get_weather"))  # its required argument missing
    assert not valid(schema, call("get_weather", city=3))
    assert not valid(schema, call("get_weather", city="Paris", days=3))  # additionalProperties: false
    assert not valid(schema, {"name": "get_weather"}) and not valid(schema, [call("get_weather", city="Paris")])
    assert not valid(schema, {**call("get_weather", city="Paris"), "why": "because"})


def test_a_required_schema_takes_one_or_more_calls_of_any_tool_or_one_without_parallel_calls():
    parallel = tool_choice_schema(TOOLS)
    assert valid(parallel, [call("get_weather", city="Paris")])
    assert valid(parallel, [call("add", a=1, b=2), call("get_weather", city="Rome")])
    assert not valid(parallel, []) and not valid(parallel, call("add", a=1, b=2))
    assert not valid(parallel, [call("add", a=1)]) and not valid(parallel, [call("search", q="x")])
    single = tool_choice_schema(TOOLS, parallel=False)
    assert valid(single, call("add", a=1, b=2)) and valid(single, call("get_weather", city="Oslo"))
    assert not valid(single, [call("add", a=1, b=2)]) and not valid(single, call("add", a="1", b=2))


def test_references_inside_a_tools_parameters_still_resolve_where_the_schema_puts_them():
    schema = tool_choice_schema([WEATHER_TOOL, PERSON_TOOL])
    home = {"street": "1 Rue", "city": "Paris"}
    assert valid(schema, [call("save_person", name="Ada", home=home, past=[home])])
    assert not valid(schema, [call("save_person", name="Ada", home={"street": "1 Rue"})])  # Address needs a city
    assert not valid(schema, [call("save_person", name="Ada", home=home, past=[{"city": 3}])])
    assert set(schema["$defs"]) == {"get_weather", "save_person", "save_person.Address"}
    assert "$defs" not in schema["$defs"]["save_person"]  # moved up, so "#/$defs/..." finds them


def test_a_schema_that_refers_to_its_own_root_still_does():
    tree = {"type": "object", "properties": {"label": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["label"]}
    schema = tool_choice_schema([{"type": "function", "function": {"name": "tree", "parameters": tree}}], "tree")
    assert valid(schema, call("tree", label="a", children=[{"label": "b", "children": [{"label": "c"}]}]))
    assert not valid(schema, call("tree", label="a", children=[{"children": []}]))


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('[\n  {"name": "add", "arguments": {"a": 1, "b": 2}}\n]', [("add", {"a": 1, "b": 2})]),
])
def test_a_forced_answer_becomes_its_tool_calls(text, calls):
    found = forced_tool_calls(TOOLS, text)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == calls
    ids = [c.id for c in found.tool_calls]
    assert len(set(ids)) == len(calls) and all(i.startswith("call_") for i in ids)
    assert found.tool_calls[0].to_openai()["type"] == "function"


def test_a_forced_answer_cut_off_before_a_name_is_content():
    found = forced_tool_calls(TOOLS, '[{"arguments": {"a": 1')
    assert found.tool_calls == [] and found.content == '{"arguments": {"a": 1'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


AUTO = ToolCallingOptions.resolve(PluginManager().load(autoload=False), True, "hermes")


def test_the_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert plan_tools(request(), AUTO).choice == "none"
    planned = plan_tools(request(tools=TOOLS), AUTO)
    assert planned.choice == "auto" and planned.new_parser().extract_tool_calls("Hi").content == "Hi"
    message, reason = planned.message('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
                                      "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert plan_tools(request(tools=TOOLS), AUTO).message("Hello", "length") == (
        {"role": "assistant", "content": "Hello"}, "length")


def test_a_forced_choice_puts_the_calls_schema_in_the_sampling_params():
    named = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), AUTO)
    params = named.constrain(SamplingParams(max_tokens=8))
    assert params.structured_outputs.json == tool_choice_schema(TOOLS, "add") and params.max_tokens == 8
    required = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), AUTO)
    assert required.constrain(SamplingParams()).structured_outputs.json == tool_choice_schema(TOOLS, parallel=False)
    assert plan_tools(request(tools=TOOLS, tool_choice="none"), AUTO).constrain(SamplingParams()).structured_outputs \
        is None
    refused = InvalidRequestError("structured outputs have no backend", param="structured_outputs")
    explained = required.explain_refusal(refused)
    assert isinstance(explained, APIError) and explained.param == "tool_choice" and "'required'" in explained.message


def test_auto_needs_the_servers_flags():
    with pytest.raises(APIError, match=r"--enable-auto-tool-choice --tool-call-parser NAME \(installed parsers: "
                                       r"hermes, llama3_json, openai, pythonic\)"):
        plan_tools(request(tools=[ADD_TOOL]), ToolCallingOptions.resolve(PluginManager().load(autoload=False)))


def test_the_servers_tool_options_are_checked_when_it_starts():
    pm = PluginManager().load(autoload=False)
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser NAME"):
        ToolCallingOptions.resolve(pm, enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="unknown tool-call parser 'hermez' for --tool-call-parser"):
        ToolCallingOptions.resolve(pm, True, "hermez")


def test_history_tool_fields_take_the_shape_hugging_face_templates_expect():
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]})
    assert template_tool_fields(assistant, 1) == {"tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    tool = ChatMessage.model_validate({"role": "tool", "content": "3", "tool_call_id": "call_1"})
    assert template_tool_fields(tool, 2) == {"tool_call_id": "call_1"}
    user = ChatMessage.model_validate({"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]})
    with pytest.raises(APIError, match="only assistant messages carry tool calls"):
        template_tool_fields(user, 0)
