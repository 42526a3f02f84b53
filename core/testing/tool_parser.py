"""Tool-call parser checks: answers read whole and streamed in any split agree, and give the calls expected."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagoda.interfaces import ToolParserFactory
from pagoda.testing.contract import ContractError, Where
from pagoda.tool_calls import join_deltas

# the tools the checks' requests carry, unless the caller gives its own
DEFAULT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "The sum of two numbers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                      "b": {"type": "number"}}}}},
]


@dataclass(frozen=True)
class ToolParserCase:
    """An answer as the model writes it in the parser's format, and what it holds: the content (None: nothing
    outside the calls) and the calls as ``(name, arguments)``, the arguments decoded (a dict)."""

    output: str
    content: Optional[str]
    calls: Sequence[tuple[str, Any]] = ()


# answers with no call in any format: each must come back whole, as content
PLAIN_CASES = [
    ToolParserCase("It is 18 degrees and sunny in Paris.", "It is 18 degrees and sunny in Paris."),
    ToolParserCase("Sums: 2 + 2 = 4, and 3 < 5 > 1.\n\nDone. ", "Sums: 2 + 2 = 4, and 3 < 5 > 1.\n\nDone. "),
    ToolParserCase("", ""),
]


def check_tool_parser(factory: ToolParserFactory, cases: Sequence[ToolParserCase],
                      tools: Optional[list[dict]] = None, seed: int = 0, num_splits: int = 25) -> None:
    """Check a ``pagoda_tool_parsers`` factory on ``cases`` (answers in its format, with calls and without)
    and on plain answers: read whole (``extract_tool_calls``), each must give the content and calls expected,
    with unique ids and JSON arguments; read as a stream split in one piece, a character at a time and at
    ``num_splits`` random places (from ``seed``), each must give, by the delta rules, exactly what the whole
    read gave; and a parser's whole read must not depend on a stream it is reading. ``tools`` are the
    request's (default: ``get_weather(city)`` and ``add(a, b)``). Raises ContractError."""
    tools = DEFAULT_TOOLS if tools is None else tools
    name = getattr(factory, "__name__", repr(factory))
    rng = random.Random(seed)
    for number, case in enumerate([*cases, *PLAIN_CASES]):
        where = Where(name, seed, step=number, step_name="case")
        whole = factory(tools).extract_tool_calls(case.output)
        _check_expected(where, case, whole)
        splits = [[case.output], list(case.output)]
        for _ in range(num_splits):
            cuts = sorted(rng.sample(range(1, len(case.output)), min(rng.randint(1, 8), len(case.output) - 1))) \
                if len(case.output) > 1 else []
            splits.append([case.output[i:j] for i, j in zip([0, *cuts], [*cuts, len(case.output)])])
        for pieces in splits:
            _check_stream(where, factory(tools), case.output, pieces, whole)


def _check_expected(where: Where, case: ToolParserCase, whole: Any) -> None:
    operation = f"extract_tool_calls({_short(case.output)})"
    suspect = "the parser's extract_tool_calls()"
    got = [(call.name, call.arguments) for call in whole.tool_calls]
    if [n for n, _ in got] != [n for n, _ in case.calls]:
        raise where.fail(operation, f"the calls are {got}, expected {list(case.calls)}",
                         "every call the answer makes is found, in order", suspect)
    for (call_name, arguments), (_, expected) in zip(got, case.calls):
        try:
            decoded = json.loads(arguments)
        except (TypeError, ValueError):
            raise where.fail(operation, f"the arguments of {call_name} are {arguments!r}, not JSON",
                             "arguments are a JSON text", suspect) from None
        if decoded != expected:
            raise where.fail(operation, f"the arguments of {call_name} are {decoded!r}, expected {expected!r}",
                             "the arguments are the ones the answer wrote", suspect)
    ids = [call.id for call in whole.tool_calls]
    if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
        raise where.fail(operation, f"the call ids are {ids}", "each call has an id of its own (a non-empty string)",
                         suspect)
    if whole.content != case.content:
        raise where.fail(operation, f"the content is {whole.content!r}, not {case.content!r}",
                         "the text outside the calls is the content (None when there is none); an answer "
                         "without calls is content as written", suspect)


def _check_stream(where: Where, parser: Any, output: str, pieces: list[str], whole: Any) -> None:
    operation = f"extract_tool_calls_streaming() of {_short(output)} in {len(pieces)} pieces"
    suspect = "the parser's extract_tool_calls_streaming() or finish_streaming()"
    deltas = []
    for i, piece in enumerate(pieces):
        deltas.append(parser.extract_tool_calls_streaming(piece))
        if i == len(pieces) // 2:  # a whole read in the middle of a stream is a read of its own
            try:
                again = _shape(parser.extract_tool_calls(output))
            except Exception as exc:  # noqa: BLE001 - what it raised is what the report says
                again = f"{type(exc).__name__}: {exc}"
            if again != _shape(whole):
                raise where.fail(f"extract_tool_calls({_short(output)}) while streaming",
                                 f"it gave {again}, and {_shape(whole)} on a fresh parser",
                                 "a whole read does not depend on a stream the parser is reading",
                                 "the parser's extract_tool_calls()")
    deltas.append(parser.finish_streaming())
    try:
        streamed = join_deltas(deltas)
    except ValueError as exc:
        raise where.fail(operation, str(exc), "the first delta of a call carries its id and name, later ones only "
                                              "arguments; indices count from 0", suspect) from None
    if _shape(streamed) != _shape(whole):
        raise where.fail(operation, f"the stream adds up to {_shape(streamed)}, the whole read to {_shape(whole)} "
                                    f"(pieces {pieces!r:.300})",
                         "a stream, split anywhere, gives what reading the answer whole gives", suspect)
    ids = [call.id for call in streamed.tool_calls]
    if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
        raise where.fail(operation, f"the streamed call ids are {ids}", "each call has an id of its own", suspect)


def _shape(result: Any) -> tuple:
    """What must agree between reads: the content (None as ""), and each call's name and arguments."""
    return result.content or "", [(call.name, call.arguments) for call in result.tool_calls]


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57]) + "..."


__all__ = ["ContractError", "DEFAULT_TOOLS", "ToolParserCase", "check_tool_parser"]
