"""The output items of a /v1/responses answer (pagoda.plugins.entrypoints.server.responses_output) on their own:
an answer read in pieces, as a stream reads it, gives the items of the same answer read whole, and its events come
in OpenAI's order; text becomes a message item, each call a function_call item."""

from __future__ import annotations

import pytest

from pagoda.plugins.entrypoints.server.responses_output import ResponseOutput
from pagoda.plugins.entrypoints.tool_parsers.forced import ForcedToolCallParser
from pagoda.plugins.entrypoints.tool_parsers.hermes import HermesToolParser
from tool_calling_helpers import TOOLS

HERMES_ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
FORCED_ANSWER = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def read(output: ResponseOutput, text: str, piece: int, status: str = "completed") -> list[tuple[str, dict]]:
    events = []
    for start in range(0, len(text), piece):
        events += output.read(text[start:start + piece], [], start + piece >= len(text))
    return events + output.finish(status)


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("piece", [1, 2, 7])
def test_an_answer_read_in_pieces_gives_the_items_of_the_whole_answer(piece):
    streamed, whole = ResponseOutput(HermesToolParser(TOOLS)), ResponseOutput(HermesToolParser(TOOLS))
    read(streamed, HERMES_ANSWER, piece)
    read(whole, HERMES_ANSWER, len(HERMES_ANSWER))
    assert without_ids(streamed.render()) == without_ids(whole.render()) == [
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "name": "add", "arguments": '{"a": 1, "b": 2}', "status": "completed"}]
    assert [item["call_id"] for item in streamed.render()[1:]] != [item["call_id"] for item in whole.render()[1:]]


def test_each_items_events_come_between_its_added_and_its_done():
    output = ResponseOutput(HermesToolParser(TOOLS))
    kinds = []
    for kind, fields in read(output, HERMES_ANSWER, 3):
        if not kinds or kinds[-1] != kind or not kind.endswith(".delta"):  # a run of deltas counts once
            kinds.append(kind)
        if "output_index" in fields and "item_id" in fields:
            assert fields["item_id"] == output.items[fields["output_index"]].id
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * 2
    added = [fields["item"] for kind, fields in read(ResponseOutput(HermesToolParser(TOOLS)), HERMES_ANSWER, 3)
             if kind == "response.output_item.added"]
    assert [item["status"] for item in added] == ["in_progress"] * 3
    assert added[0]["content"] == [] and added[1]["arguments"] == ""


def test_a_forced_answer_is_function_call_items_only_and_the_store_gets_them_as_input_items():
    output = ResponseOutput(ForcedToolCallParser(TOOLS))
    read(output, FORCED_ANSWER, 5)
    [call] = output.render()
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert output.text == "" and output.as_input() == [{"type": "function_call", "call_id": call["call_id"],
                                                        "name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_plain_text_carries_its_logprobs_and_an_empty_answer_is_one_empty_message():
    output = ResponseOutput()
    logprob = {"token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": []}
    events = output.read("Hi", [logprob], False) + output.finish("completed")
    assert events[2] == ("response.output_text.delta", {"item_id": output.items[0].id, "output_index": 0,
                                                        "content_index": 0, "delta": "Hi", "logprobs": [logprob]})
    assert output.render()[0]["content"][0]["logprobs"] == [logprob]
    empty = ResponseOutput(HermesToolParser(TOOLS))
    empty.read("", [], True)
    kinds = [kind for kind, _ in empty.finish("incomplete")]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert [(item["type"], item["status"], item["content"][0]["text"]) for item in empty.render()] == [
        ("message", "incomplete", "")]


def test_the_item_a_token_budget_cut_is_incomplete_and_those_before_it_are_complete():
    output = ResponseOutput(HermesToolParser(TOOLS))
    cut = HERMES_ANSWER[:HERMES_ANSWER.index('"b"')]
    read(output, cut, 4, status="incomplete")
    assert [(item["type"], item["status"]) for item in output.render()] == [
        ("message", "completed"), ("function_call", "completed"), ("function_call", "incomplete")]
    assert output.render()[2]["arguments"] == '{"a": 1, '
