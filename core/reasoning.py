"""The reasoning contract: what a reasoning parser (``pagoda_reasoning_parsers``) returns for a model's answer.

A reasoning model writes its thinking before its answer (between ``<think>`` tags, or in the ``analysis``
channel of gpt-oss's harmony format). A parser splits the text of one answer into ``reasoning`` (what the
server sends as ``reasoning_content``, and as reasoning items in the Responses API) and ``content`` (the answer,
which the tool-call parser then reads). Read whole or as it is generated, the pieces joined are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class ReasoningDelta:
    """What a piece of an answer adds: new thinking, new answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def __add__(self, other: "ReasoningDelta") -> "ReasoningDelta":
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


def join_reasoning(deltas: Iterable[ReasoningDelta]) -> ReasoningDelta:
    """The answer a stream of deltas adds up to."""
    reasoning, content = [], []
    for delta in deltas:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    return ReasoningDelta("".join(reasoning), "".join(content))
