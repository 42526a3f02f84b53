"""The built-in reasoning parsers (deepseek_r1, qwen3, openai_gptoss) on answers read whole, split at every
character, and streamed token by token as the default model's tokenizer cuts them (the tags are several of
its tokens, so a tag arrives in pieces)."""

from __future__ import annotations

import pytest
import transformers

from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.reasoning_parsers import BUILT_IN_REASONING_PARSERS
from pagoda.reasoning import ReasoningDelta, join_reasoning
from pagoda.registry.plugin_manager import PluginManager

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"
HARMONY_PROMPT = "<|start|>user<|message|>Hi<|end|><|start|>assistant"

CASES = [
    # (parser, prompt, answer, reasoning, content)
    ("qwen3", QWEN3_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "Hello!"),
    ("qwen3", QWEN3_PROMPT, "Hello! <think> is a tag.", "", "Hello! <think> is a tag."),
    ("qwen3", QWEN3_PROMPT, "<think>cut off while thi", "cut off while thi", ""),
    ("qwen3", QWEN3_NO_THINKING, "Hello!", "", "Hello!"),
    ("qwen3", QWEN3_NO_THINKING, "<think>x</think>y", "", "<think>x</think>y"),  # thinking was switched off
    ("deepseek_r1", R1_PROMPT, "Greet back.\n</think>\n\nHello!", "Greet back.\n", "Hello!"),
    ("deepseek_r1", "", "<think>Greet back.</think>Hello! 2 < 3", "Greet back.", "Hello! 2 < 3"),
    ("deepseek_r1", "", "Still thinking </thin", "Still thinking </thin", ""),
    ("openai_gptoss", HARMONY_PROMPT,
     "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
     "Greet back.", "Hello!"),
    ("openai_gptoss", HARMONY_PROMPT,
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     "Need weather.",
     "<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{\"city\": \"Paris\"}<|call|>"),
    ("openai_gptoss", HARMONY_PROMPT, "not harmony at all", "", "not harmony at all"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ensure_default_model())


def streamed(parser, pieces) -> ReasoningDelta:
    return join_reasoning([*(parser.extract_reasoning_streaming(p) for p in pieces), parser.finish_streaming()])


@pytest.mark.parametrize("name, prompt, answer, reasoning, content", CASES)
def test_an_answer_read_whole_or_split_anywhere_gives_its_thinking_and_its_answer(name, prompt, answer, reasoning,
                                                                                   content):
    factory = BUILT_IN_REASONING_PARSERS[name]
    expected = ReasoningDelta(reasoning, content)
    assert factory(prompt).extract_reasoning(answer) == expected
    for cut in range(len(answer) + 1):
        assert streamed(factory(prompt), [answer[:cut], answer[cut:]]) == expected, cut
    assert streamed(factory(prompt), list(answer)) == expected


@pytest.mark.parametrize("name, prompt, answer, reasoning, content", CASES)
def test_an_answer_streamed_token_by_token_gives_the_same_split(tokenizer, name, prompt, answer, reasoning, content):
    ids = tokenizer.encode(answer, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    pieces = [texts[i + 1][len(texts[i]):] for i in range(len(ids))]
    assert "".join(pieces) == answer
    parser = BUILT_IN_REASONING_PARSERS[name](prompt)
    deltas = [parser.extract_reasoning_streaming(p) for p in pieces] + [parser.finish_streaming()]
    assert join_reasoning(deltas) == ReasoningDelta(reasoning, content)
    for delta in deltas:  # no piece of a tag or marker ever goes out
        assert "</think" not in delta.reasoning and "<|end|>" not in delta.reasoning


def test_thinking_switched_off_in_the_prompt_is_known_before_the_answer():
    assert BUILT_IN_REASONING_PARSERS["qwen3"](QWEN3_PROMPT).may_think
    assert not BUILT_IN_REASONING_PARSERS["qwen3"](QWEN3_NO_THINKING).may_think
    assert BUILT_IN_REASONING_PARSERS["deepseek_r1"](R1_PROMPT).may_think


def test_harmony_answers_are_decoded_with_their_special_tokens():
    assert not BUILT_IN_REASONING_PARSERS["openai_gptoss"]("").skip_special_tokens
    assert BUILT_IN_REASONING_PARSERS["qwen3"]("").skip_special_tokens


def test_the_reasoning_parsers_are_a_plugin_kind_of_their_own():
    pm = PluginManager().load(autoload=False)
    assert set(BUILT_IN_REASONING_PARSERS) <= set(pm.names("pagoda_reasoning_parsers"))


# ---- gpt-oss's tool calls: the openai tool-call parser ---------------------------------------------------------

HARMONY_CALL = ("<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>"
                "{\"city\": \"Paris\"}<|call|>")


def test_the_openai_tool_parser_meets_the_contract_on_harmony_calls():
    from pagoda.plugins.entrypoints.tool_parsers.openai import OpenAIToolParser
    from pagoda.testing import ToolParserCase, check_tool_parser

    check_tool_parser(OpenAIToolParser, [
        ToolParserCase(HARMONY_CALL, None, [("get_weather", {"city": "Paris"})]),
        # a whole harmony answer: thinking left out, the recipient after the channel, two calls
        ToolParserCase("<|channel|>analysis<|message|>Two cities.<|end|><|start|>assistant<|channel|>commentary "
                       "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>"
                       "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{\"a\": 1, \"b\": 2}"
                       "<|call|>", None, [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
        ToolParserCase("<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny."),
    ])


def test_a_harmony_answer_reads_into_thinking_content_and_calls_through_both_parsers():
    from pagoda.plugins.entrypoints.tool_parsers.openai import OpenAIToolParser

    answer = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
    read = BUILT_IN_REASONING_PARSERS["openai_gptoss"](HARMONY_PROMPT).extract_reasoning(answer)
    calls = OpenAIToolParser([]).extract_tool_calls(read.content)
    assert read.reasoning == "Need weather." and calls.content is None
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [("get_weather", "{\"city\": \"Paris\"}")]


def test_the_built_in_reasoning_parsers_pass_the_kit_and_the_kit_catches_a_leaky_one():
    from pagoda.testing import ContractError, ReasoningParserCase, check_reasoning_parser
    from pagoda.plugins.entrypoints.reasoning_parsers.think import Qwen3ReasoningParser

    for name in BUILT_IN_REASONING_PARSERS:
        check_reasoning_parser(BUILT_IN_REASONING_PARSERS[name],
                               [ReasoningParserCase(*case[1:]) for case in CASES if case[0] == name])

    class Leaky(Qwen3ReasoningParser):  # streams the end tag into the thinking when it is cut in two
        def extract_reasoning_streaming(self, delta_text):
            return ReasoningDelta(delta_text, "") if "</" in delta_text else super().extract_reasoning_streaming(
                delta_text)

    with pytest.raises(ContractError, match="Leaky, seed 0, case 0.*Rule broken"):
        check_reasoning_parser(Leaky, [ReasoningParserCase(*CASES[0][1:])])


def test_reasoning_end_finds_the_end_of_the_thinking_in_token_ids_and_the_kit_checks_it():
    from transformers import AutoTokenizer

    from pagoda.modeling.default_model import ensure_default_model
    from pagoda.testing import ContractError, ReasoningParserCase, check_reasoning_parser
    from pagoda.plugins.entrypoints.reasoning_parsers.think import DeepSeekR1ReasoningParser

    # the default model's tokenizer writes the tags in several tokens: the end is read on their text
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    for name in BUILT_IN_REASONING_PARSERS:
        check_reasoning_parser(BUILT_IN_REASONING_PARSERS[name],
                               [ReasoningParserCase(*case[1:]) for case in CASES if case[0] == name],
                               num_splits=2, tokenizer=tokenizer)
    ids = tokenizer.encode("hmm</think>\n\n{}", add_special_tokens=False)
    end = DeepSeekR1ReasoningParser("").reasoning_end(ids, tokenizer)
    assert tokenizer.decode(ids[:end]) == "hmm</think>"
    assert BUILT_IN_REASONING_PARSERS["qwen3"](QWEN3_NO_THINKING).reasoning_end([], tokenizer) == 0
    assert BUILT_IN_REASONING_PARSERS["qwen3"]("").reasoning_end(tokenizer.encode(" {}"), tokenizer) == 0
    harmony = tokenizer.encode("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final"
                               "<|message|>{}", add_special_tokens=False)
    end = BUILT_IN_REASONING_PARSERS["openai_gptoss"]("").reasoning_end(harmony, tokenizer)
    assert tokenizer.decode(harmony[end:]) == "{}"

    class Late(DeepSeekR1ReasoningParser):  # forgets where the thinking ended once the answer grows
        def reasoning_end(self, token_ids, tokenizer):
            end = super().reasoning_end(token_ids, tokenizer)
            return None if end is None else len(token_ids)

    with pytest.raises(ContractError, match="reasoning_end"):
        check_reasoning_parser(Late, [ReasoningParserCase(*case[1:]) for case in CASES if case[0] == "deepseek_r1"],
                               num_splits=1, tokenizer=tokenizer)
