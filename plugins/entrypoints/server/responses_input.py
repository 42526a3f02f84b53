"""What a ``/v1/responses`` request gives the chat template: its conversation as chat messages, and its tools.

A conversation is a list of items: the items of the stored responses it continues, then the request's input.
Items are messages, function calls a model made, and the outputs the caller sends back for them. They become
the messages chat completions takes for the same conversation, with the same rules for tool calls
(:func:`~pagoda.plugins.entrypoints.server.tools.template_tool_call`): an assistant message carries the calls
that follow its text in ``tool_calls``, and each function call output is a ``tool`` message naming its call.
Tools arrive in the Responses API's flat shape and go on in chat's (``{"type": "function", "function":
{...}}``), which chat templates and tool-call parsers take.
"""

from __future__ import annotations

from typing import Any

from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem,
                                                                  ResponsesRequest, ToolChoiceFunction)
from pagoda.plugins.entrypoints.server.tools import (ToolCallingOptions, ToolRequest, plan_tool_choice,
                                                     template_tool_call)

# how this API writes a tool choice that names a function, for the messages that suggest one
NAMED_CHOICE = '{"type": "function", "name": ...}'


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as plain items (text parts joined), the form the response store keeps."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [_plain(item) for item in body.input]


def _plain(item: Any) -> dict:
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if isinstance(item, FunctionCallOutputItem):
        return {"type": "function_call_output", "call_id": item.call_id, "output": item.text()}
    return {"type": "message", "role": item.role, "content": item.text()}


def chat_messages(history: list[dict], inputs: list[dict]) -> list[dict]:
    """The conversation (the stored ``history``, then this request's ``inputs``, as plain items) as the chat
    template takes it. The request's own items are checked, a 400 naming the item: a call's arguments must be
    JSON, and an output must answer a call that comes before it."""
    messages: list[dict] = []
    call_ids: set[str] = set()
    for position, item in enumerate(history + inputs):
        where = f"input.{position - len(history)}" if position >= len(history) else None
        if item["type"] == "function_call":
            # calls the model wrote may be cut off by its token budget: those stay text (where is None)
            call = template_tool_call(item["call_id"], item["name"], item["arguments"],
                                      f"{where}.arguments" if where else None)
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)  # the calls that follow a text are its own
            call_ids.add(item["call_id"])
        elif item["type"] == "function_call_output":
            if where is not None and item["call_id"] not in call_ids:
                raise APIError(400, f"{where} is the output of the call {item['call_id']!r}, but no function_call "
                                    "item with that call_id comes before it, in the input or in the conversation "
                                    "of previous_response_id; send the function_call item (as the response gave "
                                    "it) before its output", param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": item["content"]})
    return messages


def plan_response_tools(body: ResponsesRequest, options: ToolCallingOptions) -> ToolRequest:
    """The request's tools and tool choice, by chat completions' rules: ``auto`` (the default with tools) needs
    the server's tool-call parser, ``required`` and a named function are enforced with structured outputs.
    Unlike chat, ``auto`` without tools is allowed (it is this API's default): the answer is text."""
    tools = [t.as_chat_tool() for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return plan_tool_choice(tools, "function", choice.name, body.parallel_tool_calls, options, NAMED_CHOICE)
    if tools is None and choice == "auto":
        choice = None
    return plan_tool_choice(tools, choice, None, body.parallel_tool_calls, options, NAMED_CHOICE)
