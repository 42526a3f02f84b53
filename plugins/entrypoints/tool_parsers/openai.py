"""``openai``: gpt-oss's tool calls in OpenAI's harmony format, messages to ``functions.NAME`` on the
``commentary`` channel whose body is the arguments' JSON::

    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The recipient may stand in the header before or after the channel (gpt-oss writes both). Read after the
``openai_gptoss`` reasoning parser (which passes calls on in that form), or on a whole harmony answer: the bodies
of ``final`` and ``commentary`` messages to no tool are content, ``analysis`` bodies are left out (they are the
thinking), and text outside any message is content. The markers are special tokens: the server keeps them when
the ``openai_gptoss`` reasoning parser runs; without it, send ``"skip_special_tokens": false``.
"""

from __future__ import annotations

from typing import Optional

from pagoda.tool_calls import DeltaMessage, ExtractedToolCalls, ToolCallDelta, join_deltas, new_tool_call_id

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
MAX_HEADER_CHARS = 256


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may begin one of ``markers``."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _header(text: str) -> tuple[Optional[str], Optional[str]]:
    """A header's channel and recipient."""
    channel = recipient = None
    if CHANNEL in text:
        rest = text.split(CHANNEL, 1)[1].lstrip()
        channel = rest.split(None, 1)[0].split("<|", 1)[0] if rest else None
    if "to=" in text:
        recipient = text.split("to=", 1)[1].split("<|", 1)[0].split(None, 1)[0]
    return channel, recipient


class OpenAIToolParser:
    """A :class:`pagoda.interfaces.ToolParser` for harmony messages: a message to ``functions.NAME`` is a call
    of NAME, its body streamed as the arguments."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self._pending = ""
        self._mode = "text"  # text | header | body | between
        self._kind = "content"  # what the open message's body is: content, call, or hidden (analysis)
        self._num_calls = 0
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        whole = OpenAIToolParser(self.tools)
        return join_deltas([whole.extract_tool_calls_streaming(model_output), whole.finish_streaming()])

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self._pending += delta_text
        self._read(is_final=False)
        return self._take()

    def finish_streaming(self) -> DeltaMessage:
        self._read(is_final=True)
        return self._take()

    def _read(self, is_final: bool) -> None:
        while self._pending:
            if self._mode in ("text", "between"):
                starts = [i for i in (self._pending.find(START), self._pending.find(CHANNEL)) if i >= 0]
                at = min(starts) if starts else -1
                if at < 0:
                    keep = 0 if is_final else _partial(self._pending, (START, CHANNEL))
                    self._content.append(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                self._content.append(self._pending[:at])
                self._pending = self._pending[at:]
                if self._pending.startswith(START):
                    self._pending = self._pending[len(START):]
                self._mode = "header"
            elif self._mode == "header":
                at = self._pending.find(MESSAGE)
                if at < 0:
                    if is_final or len(self._pending) > MAX_HEADER_CHARS:  # not a message after all
                        self._content.append(self._pending)
                        self._pending, self._mode = "", "text"
                    return
                channel, recipient = _header(self._pending[:at])
                self._pending = self._pending[at + len(MESSAGE):]
                self._mode = "body"
                if recipient is not None and recipient.startswith(FUNCTIONS):
                    self._kind = "call"
                    self._calls.append(ToolCallDelta(self._num_calls, new_tool_call_id(), recipient[len(FUNCTIONS):]))
                    self._num_calls += 1
                else:
                    self._kind = "hidden" if channel == "analysis" else "content"
            else:  # body
                ends = [(self._pending.find(m), m) for m in ENDS if m in self._pending]
                if ends:
                    at, marker = min(ends)
                    self._body(self._pending[:at])
                    self._pending = self._pending[at + len(marker):]
                    self._mode = "between"
                    continue
                keep = 0 if is_final else _partial(self._pending, ENDS)
                self._body(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "call":
            self._calls.append(ToolCallDelta(self._num_calls - 1, arguments=text))
        elif self._kind == "content":
            self._content.append(text)

    def _take(self) -> DeltaMessage:
        merged: dict[int, ToolCallDelta] = {}
        for piece in self._calls:
            before = merged.get(piece.index)
            merged[piece.index] = piece if before is None else ToolCallDelta(
                piece.index, before.id, before.name, before.arguments + piece.arguments)
        message = DeltaMessage("".join(self._content), list(merged.values()))
        self._content, self._calls = [], []
        return message
