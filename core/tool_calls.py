"""The tool-call contract: what a tool-call parser (``pagoda_tool_parsers``) returns for a model's answer.

A parser reads the text of one answer and splits it into the content the user sees and the tool calls the
model made, each a function name with its arguments as a JSON string, as OpenAI's ``tool_calls`` carry them.
Read whole, it returns :class:`ExtractedToolCalls`; read as it is generated, it returns one
:class:`DeltaMessage` per piece of text: new content, and :class:`ToolCallDelta` s whose first one for a call
(by ``index``) carries its ``id`` and ``name`` and whose ``arguments`` fragments, joined, are the call's
arguments. :func:`join_deltas` puts a stream back together.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Iterable, Optional


def new_tool_call_id() -> str:
    """A fresh id for a tool call, in OpenAI's style (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool: ``arguments`` is a JSON text (usually an object), as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call in OpenAI's shape (an element of ``message.tool_calls``)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole answer read: ``content`` is the text outside the calls (None when the model wrote nothing
    else), ``tool_calls`` the calls in the order the model made them."""

    content: Optional[str]
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """What one piece of streamed text adds to call number ``index`` (from 0, in order of appearance): its
    ``id`` and ``name`` in the first delta of the call only, then ``arguments`` fragments."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The delta in OpenAI's shape (an element of ``delta.tool_calls``)."""
        delta: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            delta.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is not None:
            function["arguments"] = self.arguments
        if function:
            delta["function"] = function
        return delta


@dataclass(frozen=True)
class DeltaMessage:
    """What one piece of streamed text adds to the answer: new content, new call pieces (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def join_deltas(deltas: Iterable[DeltaMessage]) -> ExtractedToolCalls:
    """The answer a stream of deltas adds up to. Raises ValueError for a stream that breaks the contract: a call
    whose first delta lacks its id or name, a second id or name for a call, indices that skip a number."""
    content: list[str] = []
    calls: list[dict] = []
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                if piece.id is None or piece.name is None:
                    raise ValueError(f"the first delta of tool call {piece.index} has no "
                                     f"{'id' if piece.id is None else 'name'}; it must carry both")
                calls.append({"id": piece.id, "name": piece.name, "arguments": [piece.arguments]})
            elif 0 <= piece.index < len(calls):
                if piece.id is not None or piece.name is not None:
                    raise ValueError(f"a later delta of tool call {piece.index} carries an id or a name again; only "
                                     "its first delta may")
                calls[piece.index]["arguments"].append(piece.arguments)
            else:
                raise ValueError(f"tool call index {piece.index} skips a number: {len(calls)} calls began before it")
    text = "".join(content)
    return ExtractedToolCalls(text if text or not calls else None,
                              [ToolCall(c["id"], c["name"], "".join(c["arguments"])) for c in calls])
