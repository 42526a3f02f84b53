"""Reasoning parser checks: answers read whole and streamed in any split agree, and set the thinking apart as
expected."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from pagoda.interfaces import ReasoningParserFactory
from pagoda.reasoning import ReasoningDelta, join_reasoning
from pagoda.testing.contract import ContractError, Where


@dataclass(frozen=True)
class ReasoningParserCase:
    """An answer in the parser's format, the prompt it continues, and its thinking and answer."""

    prompt: str
    output: str
    reasoning: str
    content: str


def check_reasoning_parser(factory: ReasoningParserFactory, cases: Sequence[ReasoningParserCase], seed: int = 0,
                           num_splits: int = 25, tokenizer: Any = None) -> None:
    """Check a ``pagoda_reasoning_parsers`` factory on ``cases``: read whole (``extract_reasoning``), each gives
    the thinking and answer expected; read as a stream in one piece, a character at a time and split at
    ``num_splits`` random places (from ``seed``), each adds up to the whole read; ``skip_special_tokens`` is a
    bool. With a ``tokenizer`` (an HF tokenizer) and a parser that has the optional ``reasoning_end``: over the
    growing prefixes of each answer's ids it is None until the thinking ends, then one fixed count no larger
    than the prefix, and an answer with answer text has ended its thinking. Raises ContractError."""
    name = getattr(factory, "__name__", repr(factory))
    rng = random.Random(seed)
    for number, case in enumerate(cases):
        where = Where(name, seed, step=number, step_name="case")
        parser = factory(case.prompt)
        if not isinstance(getattr(parser, "skip_special_tokens", None), bool):
            raise where.fail("skip_special_tokens", f"it is {getattr(parser, 'skip_special_tokens', None)!r}",
                             "a bool: False asks the server to keep special tokens in the text", "the parser")
        whole = parser.extract_reasoning(case.output)
        expected = ReasoningDelta(case.reasoning, case.content)
        if whole != expected:
            raise where.fail(f"extract_reasoning({case.output!r:.80})", f"it gave {whole}, expected {expected}",
                             "the thinking and the answer are the ones the answer wrote",
                             "the parser's extract_reasoning()")
        splits = [[case.output], list(case.output)]
        for _ in range(num_splits):
            if len(case.output) > 1:
                cuts = sorted(rng.sample(range(1, len(case.output)), min(rng.randint(1, 8), len(case.output) - 1)))
                splits.append([case.output[i:j] for i, j in zip([0, *cuts], [*cuts, len(case.output)])])
        for pieces in splits:
            stream = factory(case.prompt)
            streamed = join_reasoning([*(stream.extract_reasoning_streaming(p) for p in pieces),
                                       stream.finish_streaming()])
            if streamed != whole:
                raise where.fail(f"extract_reasoning_streaming() in {len(pieces)} pieces",
                                 f"the stream adds up to {streamed}, the whole read to {whole} (pieces {pieces!r:.300})",
                                 "a stream, split anywhere, gives what reading the answer whole gives",
                                 "the parser's extract_reasoning_streaming() or finish_streaming()")
        if tokenizer is not None and hasattr(parser, "reasoning_end"):
            _check_reasoning_end(factory(case.prompt), case, tokenizer, where)


def _check_reasoning_end(parser: Any, case: ReasoningParserCase, tokenizer: Any, where: Where) -> None:
    ids = tokenizer.encode(case.output, add_special_tokens=False)
    found = None
    for size in range(len(ids) + 1):
        end = parser.reasoning_end(ids[:size], tokenizer)
        if found is not None and end != found:
            raise where.fail(f"reasoning_end(the first {size} ids of {case.output!r:.80})",
                             f"it gave {end} after {found} for a shorter prefix",
                             "once the thinking has ended in some ids, it ends at the same place in any longer ones",
                             "the parser's reasoning_end()")
        if end is not None and not 0 <= end <= size:
            raise where.fail(f"reasoning_end(the first {size} ids of {case.output!r:.80})", f"it gave {end}",
                             "a count of the ids given (0 to their number) or None", "the parser's reasoning_end()")
        found = end
    if case.content.strip() and found is None:
        raise where.fail(f"reasoning_end(the ids of {case.output!r:.80})", "it gave None",
                         f"the thinking ends before the answer {case.content!r:.60}", "the parser's reasoning_end()")


__all__ = ["ContractError", "ReasoningParserCase", "check_reasoning_parser"]
