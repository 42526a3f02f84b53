"""The built-in tool-call parsers on exact model outputs, read whole and streamed in arbitrary splits; the
contract types of pagoda.tool_calls; the kit's check_tool_parser catching broken parsers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.tool_parsers import HermesToolParser, Llama3JsonToolParser
from pagoda.plugins.entrypoints.tool_parsers.json_scanner import JsonObjectScanner
from pagoda.plugins.entrypoints.tool_parsers.pythonic import PythonicToolParser
from pagoda.registry.plugin_manager import PluginManager
from pagoda.testing import ContractError, ToolParserCase, check_tool_parser
from pagoda.testing.tool_parser import DEFAULT_TOOLS
from pagoda.tool_calls import DeltaMessage, ToolCallDelta, join_deltas

WEATHER = ("get_weather", {"city": "Paris"})
NESTED = {"city": "Paris", "when": {"day": "today", "hours": [9, 12]}, "note": "braces } ] and \"quotes\" \\ ok"}

HERMES_CASES = [
    # Qwen2.5 / Hermes 2 Pro write one object per tag, each on its own line
    ToolParserCase('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
                   [WEATHER]),
    ToolParserCase('I will look it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>', "I will look it up.", [WEATHER]),
    ToolParserCase('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
                   '{"name": "add", "arguments": {"a": 2, "b": 3.5}}\n</tool_call>', None,
                   [WEATHER, ("add", {"a": 2, "b": 3.5})]),
    ToolParserCase(f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(NESTED)}}}</tool_call>', None,
                   [("get_weather", NESTED)]),
    # the arguments first, as a JSON string, or left out
    ToolParserCase('<tool_call>{"arguments": "{\\"a\\": 1, \\"b\\": 2}", "name": "add"}</tool_call>', None,
                   [("add", {"a": 1, "b": 2})]),
    ToolParserCase('<tool_call>{"name": "get_weather"}</tool_call>', None, [("get_weather", {})]),
    # no closing tag: the model stopped after the object
    ToolParserCase('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    # unicode, and a tag-like text inside a string
    ToolParserCase('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich </tool_call> 東京"}}'
                   '</tool_call>', None, [("get_weather", {"city": "Zürich </tool_call> 東京"})]),
    # what is not a call stays text
    ToolParserCase("<tool_call>not JSON</tool_call> sorry", "<tool_call>not JSON</tool_call> sorry"),
    ToolParserCase('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
    ToolParserCase("a <tool_ca b < c", "a <tool_ca b < c"),
]

LLAMA3_CASES = [
    ToolParserCase('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    ToolParserCase('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    ToolParserCase('\n  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": '
                   '{"a": 1, "b": 2}}\n', None, [WEATHER, ("add", {"a": 1, "b": 2})]),
    ToolParserCase('{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    # JSON that is not a call of one of the tools is content
    ToolParserCase('{"answer": 4}', '{"answer": 4}'),
    ToolParserCase('{"name": "Bob", "age": 41}', '{"name": "Bob", "age": 41}'),
    ToolParserCase("The answer is {4}.", "The answer is {4}."),
]
CUT_OFF = '{"name": "get_weather", "parameters": {"city": '  # max_tokens ended the answer inside the arguments


def test_the_hermes_parser_meets_the_contract_on_its_format():
    check_tool_parser(HermesToolParser, HERMES_CASES)


def test_the_llama3_json_parser_meets_the_contract_on_its_format():
    check_tool_parser(Llama3JsonToolParser, LLAMA3_CASES)


PYTHONIC_CASES = [
    # Llama 3.2 and Gemma with a pythonic template write the whole answer as one list of calls
    ToolParserCase('[get_weather(city="Paris")]', None, [WEATHER]),
    ToolParserCase(' [get_weather(city="Paris"), add(a=2, b=3.5)]\n', None, [WEATHER, ("add", {"a": 2, "b": 3.5})]),
    ToolParserCase("[get_weather(city='Paris', when={'day': 'today', 'hours': [9, 12]}, exact=True, note=None)]",
                   None, [("get_weather", {"city": "Paris", "when": {"day": "today", "hours": [9, 12]},
                                           "exact": True, "note": None})]),
    ToolParserCase("[add(a=1, b=true)]", None, [("add", {"a": 1, "b": True})]),
    # not calls of the request's tools with literal keyword arguments: content, as written
    ToolParserCase("[search(q='x')]", "[search(q='x')]"),
    ToolParserCase("[add(1, 2)]", "[add(1, 2)]"),
    ToolParserCase("[add(a=x, b=2)]", "[add(a=x, b=2)]"),
    ToolParserCase("[1, 2, 3]", "[1, 2, 3]"),
    ToolParserCase("[get_weather(city='Paris')", "[get_weather(city='Paris')"),  # cut off
    ToolParserCase("Call [get_weather(city='Paris')]", "Call [get_weather(city='Paris')]"),
]


def test_the_pythonic_parser_meets_the_contract_on_its_format():
    check_tool_parser(PythonicToolParser, PYTHONIC_CASES)


def test_a_call_cut_off_by_max_tokens_keeps_what_was_written_of_its_arguments():
    found = Llama3JsonToolParser(DEFAULT_TOOLS).extract_tool_calls(CUT_OFF)
    assert found.content is None
    assert [(c.name, c.arguments) for c in found.tool_calls] == [("get_weather", '{"city": ')]


def stream(parser, pieces):
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish_streaming()]
    return deltas, join_deltas(deltas)


def test_hermes_streams_the_name_first_then_the_arguments_as_they_are_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ['<tool_', 'call>\n{"na', 'me": "get_weather"', ', "arguments": {"ci', 'ty": "Par', 'is"}}', '\n</tool',
              '_call>']
    assert "".join(pieces) == text
    deltas, joined = stream(HermesToolParser(DEFAULT_TOOLS), pieces)
    calls = [d.tool_calls for d in deltas]
    assert calls[:2] == [[], []]  # nothing until the name is read
    first = calls[2][0]
    assert first.index == 0 and first.name == "get_weather" and first.id.startswith("call_") and first.arguments == ""
    fragments = [c[0].arguments for c in calls[3:] if c]
    assert fragments == ['{"ci', 'ty": "Par', 'is"}'] and all(c[0].id is None for c in calls[3:] if c)
    assert all(d.content == "" for d in deltas)
    assert joined.tool_calls[0].arguments == '{"city": "Paris"}' and joined.content is None
    assert first.to_openai() == {"index": 0, "id": first.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}
    assert ToolCallDelta(0, arguments='{"ci').to_openai() == {"index": 0, "function": {"arguments": '{"ci'}}


def test_hermes_holds_back_only_what_may_begin_a_tag():
    parser = HermesToolParser(DEFAULT_TOOLS)
    assert parser.extract_tool_calls_streaming("It is sunny <to").content == "It is sunny"
    assert parser.extract_tool_calls_streaming("day.").content == " <today."
    assert parser.finish_streaming() == DeltaMessage()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_of_an_answer_streams_to_the_whole_read(data):
    parser_class, texts = data.draw(st.sampled_from([
        (HermesToolParser, [c.output for c in HERMES_CASES]),
        (Llama3JsonToolParser, [c.output for c in LLAMA3_CASES] + [CUT_OFF])]))
    text = data.draw(st.sampled_from(texts))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    whole = parser_class(DEFAULT_TOOLS).extract_tool_calls(text)
    _, streamed = stream(parser_class(DEFAULT_TOOLS), pieces)
    assert (streamed.content or "") == (whole.content or "")
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_the_built_in_parsers_come_through_the_hook():
    pm = PluginManager().load(autoload=False)
    assert {"hermes", "llama3_json", "pythonic"} <= set(pm.names("pagoda_tool_parsers"))
    assert pm.factory("pagoda_tool_parsers", "hermes") is HermesToolParser
    assert pm.get("pagoda_tool_parsers", "hermes", "--tool-call-parser").kind == "tool-call parser"
    with pytest.raises(ConfigError, match=r"unknown tool-call parser 'hermess' for --tool-call-parser; available: "
                                        r".*'hermes'.*'llama3_json'"):
        pm.get("pagoda_tool_parsers", "hermess", "--tool-call-parser")


def test_the_json_scanner_knows_each_members_text_and_where_the_object_ends():
    scanner = JsonObjectScanner()
    text = '{"name": "f", "n": -1.5e3, "ok": true, "args": {"a": [1, "]"]}} trailing'
    taken = sum(scanner.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    assert scanner.is_done and scanner.is_valid() and taken == len(text) - len(" trailing")
    assert scanner.member("name") == "f" and scanner.member("n") == -1500 and scanner.member("ok") is True
    assert scanner.member_text("args") == '{"a": [1, "]"]}'
    bad = JsonObjectScanner()
    bad.feed('{"name" "f"}')
    assert bad.is_invalid


def test_join_deltas_refuses_a_stream_that_breaks_the_delta_rules():
    with pytest.raises(ValueError, match="first delta of tool call 0 has no id"):
        join_deltas([DeltaMessage(tool_calls=[ToolCallDelta(0, name="f")])])
    with pytest.raises(ValueError, match="skips a number"):
        join_deltas([DeltaMessage(tool_calls=[ToolCallDelta(1, "call_1", "f")])])
    with pytest.raises(ValueError, match="carries an id or a name again"):
        join_deltas([DeltaMessage(tool_calls=[ToolCallDelta(0, "call_1", "f")]),
                     DeltaMessage(tool_calls=[ToolCallDelta(0, "call_1", "f", "{}")])])


class DropsHeldText(HermesToolParser):
    """Forgets, when a streamed answer ends, the text it held back."""

    def extract_tool_calls(self, model_output):
        return HermesToolParser(self.tools).extract_tool_calls(model_output)

    def finish_streaming(self):
        super().finish_streaming()
        return DeltaMessage()


class OneId(HermesToolParser):
    """Gives every call the same id."""

    def extract_tool_calls(self, model_output):
        found = super().extract_tool_calls(model_output)
        return type(found)(found.content, [type(c)("call_1", c.name, c.arguments) for c in found.tool_calls])


class WholeReadUsesStreamState(HermesToolParser):
    """Reads a whole answer with the state of the stream it is reading."""

    def extract_tool_calls(self, model_output):
        return join_deltas([self.extract_tool_calls_streaming(model_output), self.finish_streaming()])


@pytest.mark.parametrize("broken, message", [
    (DropsHeldText, "the stream adds up to"),
    (OneId, "each call has an id of its own"),
    (WholeReadUsesStreamState, "a whole read does not depend on a stream the parser is reading"),
])
def test_a_broken_parser_is_caught_with_what_broke(broken, message):
    with pytest.raises(ContractError, match=message) as caught:
        check_tool_parser(broken, HERMES_CASES[:3])
    assert broken.__name__ in str(caught.value) and "Most likely at fault" in str(caught.value)


def test_a_parser_that_misses_a_call_is_caught():
    with pytest.raises(ContractError, match=r"the calls are \[\], expected \[\('get_weather'"):
        check_tool_parser(Llama3JsonToolParser, [ToolParserCase(
            '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER])], tools=[])
