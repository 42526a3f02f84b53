"""What a /v1/responses request gives the chat template (pagoda.plugins.entrypoints.server.responses_input), on its
own: input items become chat's messages, with calls and their outputs as Hugging Face templates take them; tools go
from the Responses API's flat shape to chat's; tool_choice follows chat's rules."""

from __future__ import annotations

import pytest

from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.responses_input import chat_messages, input_items, plan_response_tools
from pagoda.plugins.entrypoints.server.responses_protocol import ResponsesRequest
from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions
from tool_calling_helpers import ADD_TOOL, WEATHER_TOOL

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER_TOOL, ADD_TOOL)]


def call(call_id: str, city: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": f'{{"city": "{city}"}}'}


def template_call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


def test_calls_join_the_assistant_text_before_them_and_outputs_become_tool_messages():
    body = request(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris "}, {"type": "input_text",
                                                                                            "text": "and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call("c1", "Paris"), call("c2", "Rome"),
        {"type": "function_call_output", "call_id": "c1", "output": "18 degrees"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25 degrees"}]}])
    items = input_items(body)
    assert items[0] == {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"}
    assert items[5] == {"type": "function_call_output", "call_id": "c2", "output": "25 degrees"}
    assert chat_messages([], items) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [template_call("c1", "Paris"),
                                                                         template_call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "c2", "content": "25 degrees"}]


def test_an_output_may_answer_a_call_of_the_stored_conversation_whose_cut_arguments_stay_text():
    history = [{"type": "message", "role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Par'}]
    messages = chat_messages(history, [{"type": "function_call_output", "call_id": "c1", "output": "18 degrees"}])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}


def test_an_output_of_no_earlier_call_and_arguments_that_are_not_json_are_400s_naming_the_item():
    with pytest.raises(APIError) as caught:
        chat_messages([], [call("c1", "Paris"), {"type": "function_call_output", "call_id": "c2", "output": "x"}])
    assert caught.value.param == "input.1.call_id" and "'c2'" in caught.value.message
    with pytest.raises(APIError) as caught:
        chat_messages([], [{**call("c1", "Paris"), "arguments": "{city: Paris}"}])
    assert caught.value.param == "input.0.arguments" and "is not JSON" in caught.value.message


def test_flat_tools_reach_the_template_and_the_parsers_in_chats_shape():
    tooling = plan_response_tools(request(tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False),
                                  ToolCallingOptions())
    assert tooling.tools == [WEATHER_TOOL, ADD_TOOL] and tooling.choice == "required" and not tooling.parallel
    named = plan_response_tools(request(tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "add"}),
                                ToolCallingOptions())
    assert (named.choice, named.function_name, named.is_forced) == ("function", "add", True)
    assert plan_response_tools(request(tools=FLAT_TOOLS, tool_choice="none"), ToolCallingOptions()).new_parser() is None


def test_auto_needs_the_server_flags_with_tools_and_is_plain_text_without_them():
    with pytest.raises(APIError) as caught:
        plan_response_tools(request(tools=FLAT_TOOLS), ToolCallingOptions(available_parsers=("hermes",)))
    assert caught.value.param == "tool_choice"
    assert "--enable-auto-tool-choice --tool-call-parser NAME (installed parsers: hermes)" in caught.value.message
    assert '{"type": "function", "name": ...}' in caught.value.message  # this API's way to name a function
    assert plan_response_tools(request(tool_choice="auto"), ToolCallingOptions()).choice == "none"
    assert plan_response_tools(request(tools=[], tool_choice="auto"), ToolCallingOptions()).tools is None
