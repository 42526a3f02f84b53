"""The output items of one response, built as its answer is read, and the stream events that announce them.

An answer is text, or, when the request's tools are in play (``tool_choice`` ``auto``, ``required`` or a named
function), text and tool calls, which the request's tool-call reader splits apart. Its text becomes a
``message`` item with one ``output_text`` part, each call a ``function_call`` item. An item opens when its first
piece arrives and closes when the next one opens or the answer ends, so the events of a stream (OpenAI's:
``response.output_item.added``, then ``response.output_text.delta`` or ``response.function_call_arguments.delta``
pieces, then the ``.done`` events) add up to the items of the same answer read whole. With a reasoning parser,
the thinking comes first as a ``reasoning`` item (its text in one ``reasoning_text`` part, streamed as
``response.reasoning_text.delta``), and the rest of the answer is read as above.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda.tool_calls import DeltaMessage, ToolCallDelta

Event = tuple[str, dict]  # an event's type and its fields, less its sequence_number


def output_text_part(text: str = "", logprobs: Optional[list[dict]] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


@dataclass
class _Item:
    """One output item: a ``message`` (its text) or a ``function_call`` (its arguments), and where it is."""

    kind: str  # "message", "function_call" or "reasoning"
    id: str
    output_index: int
    call_id: Optional[str] = None
    name: Optional[str] = None
    pieces: list[str] = field(default_factory=list)  # the text, or the call's arguments
    logprobs: list[dict] = field(default_factory=list)
    status: str = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def render(self, is_new: bool = False) -> dict:
        """The item in OpenAI's shape; ``is_new``: as ``response.output_item.added`` shows it, empty."""
        if self.kind == "message":
            content = [] if is_new else [output_text_part(self.text, self.logprobs)]
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content}
        if self.kind == "reasoning":
            content = [] if is_new else [{"type": "reasoning_text", "text": self.text}]
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": "" if is_new else self.text, "status": self.status}

    def as_input(self) -> dict:
        """The item as the response store keeps it (the shape of an input item, text joined)."""
        if self.kind == "message":
            return {"type": "message", "role": "assistant", "content": self.text}
        return {"type": "function_call", "call_id": self.call_id, "name": self.name, "arguments": self.text}


class ResponseOutput:
    """The items of one answer. ``parser`` (a :class:`pagoda.interfaces.ToolParser`, or None for plain text)
    reads the answer into content and calls; token logprobs go with the text of plain answers only."""

    def __init__(self, parser: Any = None, reasoning_parser: Any = None) -> None:
        self.parser = parser
        self.reasoning_parser = reasoning_parser  # a pagoda.interfaces.ReasoningParser, or None
        self.items: list[_Item] = []
        self._open: Optional[_Item] = None
        self._calls: dict[int, _Item] = {}  # by the parser's call index
        self._is_read = parser is None  # the parser has read the end of the answer
        self._is_thinking_read = reasoning_parser is None  # likewise, the reasoning parser

    @property
    def text(self) -> str:
        """The answer's text outside its calls and its thinking."""
        return "".join(item.text for item in self.items if item.kind == "message")

    def read(self, text: str, logprobs: list[dict], is_last: bool) -> list[Event]:
        """Take the answer's next ``text`` (with its tokens' ``logprobs``; ``is_last``: the answer ends with it);
        the events it makes, in order."""
        if self.reasoning_parser is not None:
            read = self.reasoning_parser.extract_reasoning_streaming(text)
            if is_last:
                read = read + self.reasoning_parser.finish_streaming()
                self._is_thinking_read = True
            events = self._add_reasoning(read.reasoning) if read.reasoning else []
            if self.parser is None:
                return events + (self._add_text(read.content, []) if read.content else [])
            text, logprobs = read.content, []
            events += self._read_calls(text, is_last)
            return events
        if self.parser is None:
            return self._add_text(text, logprobs) if text or logprobs else []
        return self._read_calls(text, is_last)

    def _read_calls(self, text: str, is_last: bool) -> list[Event]:
        messages = [self.parser.extract_tool_calls_streaming(text)]
        if is_last:
            messages.append(self.parser.finish_streaming())
            self._is_read = True
        return [event for message in messages for event in self._add(message)]

    def finish(self, status: str) -> list[Event]:
        """End the answer: the open item ends with ``status`` (``completed``, or ``incomplete`` when the token
        budget cut it); an answer with no item at all gets an empty message. The closing events."""
        events = []
        if not self._is_thinking_read:
            events += self.read("", [], is_last=True)
        if not self._is_read:
            events += self._add(self.parser.finish_streaming())
        self._is_read = True
        if not self.items:
            events += self._open_item("message")
        return events + self._close(status)

    def render(self) -> list[dict]:
        return [item.render() for item in self.items]

    def as_input(self) -> list[dict]:
        """The items a later turn continues from (the thinking is left out, as chat templates drop it)."""
        return [item.as_input() for item in self.items if item.kind != "reasoning"]

    # ---- the items ----------------------------------------------------------------------------------

    def _add(self, message: DeltaMessage) -> list[Event]:
        # one piece's content comes before its calls: a parser sends the text that precedes a call first
        events = self._add_text(message.content, []) if message.content else []
        for piece in message.tool_calls:
            events += self._add_call(piece)
        return events

    def _add_text(self, text: str, logprobs: list[dict]) -> list[Event]:
        events = [] if self._open is not None and self._open.kind == "message" else self._open_item("message")
        item = self._open
        item.pieces.append(text)
        item.logprobs += logprobs
        events.append(("response.output_text.delta", {"item_id": item.id, "output_index": item.output_index,
                                                      "content_index": 0, "delta": text, "logprobs": logprobs}))
        return events

    def _add_reasoning(self, text: str) -> list[Event]:
        is_open = self._open is not None and self._open.kind == "reasoning"
        events = [] if is_open else self._open_item("reasoning")
        item = self._open
        item.pieces.append(text)
        events.append(("response.reasoning_text.delta", {"item_id": item.id, "output_index": item.output_index,
                                                         "content_index": 0, "delta": text}))
        return events

    def _add_call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.index not in self._calls:
            if piece.id is None or piece.name is None:
                raise ValueError(f"the tool-call parser sent a piece of call {piece.index} before its id and name")
            events += self._open_item("function_call", piece.id, piece.name)
            self._calls[piece.index] = self._open
        item = self._calls[piece.index]
        if piece.arguments:
            item.pieces.append(piece.arguments)
            events.append(("response.function_call_arguments.delta",
                           {"item_id": item.id, "output_index": item.output_index, "delta": piece.arguments}))
        return events

    def _open_item(self, kind: str, call_id: Optional[str] = None, name: Optional[str] = None) -> list[Event]:
        """Close the open item (it is complete: another one follows) and open a new one."""
        events = self._close("completed")
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}[kind]
        item = _Item(kind, f"{prefix}_{uuid.uuid4().hex}", len(self.items), call_id, name)
        self.items.append(item)
        self._open = item
        events.append(("response.output_item.added", {"output_index": item.output_index, "item": item.render(True)}))
        if kind == "message":
            events.append(("response.content_part.added", {"item_id": item.id, "output_index": item.output_index,
                                                           "content_index": 0, "part": output_text_part()}))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        ids = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "message":
            part = output_text_part(item.text, item.logprobs)
            events = [("response.output_text.done", {**ids, "content_index": 0, "text": item.text,
                                                     "logprobs": item.logprobs}),
                      ("response.content_part.done", {**ids, "content_index": 0, "part": part})]
        elif item.kind == "reasoning":
            events = [("response.reasoning_text.done", {**ids, "content_index": 0, "text": item.text})]
        else:
            events = [("response.function_call_arguments.done", {**ids, "arguments": item.text})]
        return events + [("response.output_item.done", {"output_index": item.output_index, "item": item.render()})]
