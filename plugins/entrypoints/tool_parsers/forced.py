"""The calls of an answer held to a tool-call JSON schema (``tool_choice`` ``required`` or a named function):
one object ``{"name": ..., "arguments": ...}``, or an array of them. Not a registered parser: the server
uses it for the answers it constrains itself, whatever ``--tool-call-parser`` says.
"""

from __future__ import annotations

from pagoda.plugins.entrypoints.tool_parsers.base import JsonToolCallParser
from pagoda.plugins.entrypoints.tool_parsers.json_scanner import WHITESPACE

_START = "start"
_ARRAY = "array"  # inside the array: separators, a call, or its end
_OBJECT = "object"
_END = "end"  # after the calls: nothing more is read
_TEXT = "text"  # not the schema's shape (cut off, or unconstrained): content to the end


class ForcedToolCallParser(JsonToolCallParser):
    """An object, or an array of objects, each a call; anything else is content."""

    argument_keys = ("arguments",)

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._mode = _START
        self._in_array = False
        self._pending = ""

    def read(self, text: str, is_final: bool) -> None:
        self._pending += text
        while self._pending:
            head = self._pending[0]
            if self._mode in (_START, _ARRAY) and (head in WHITESPACE or (self._mode == _ARRAY and head == ",")):
                self._pending = self._pending[1:]
            elif self._mode == _START and head == "[":
                self._mode, self._in_array = _ARRAY, True
                self._pending = self._pending[1:]
            elif self._mode in (_START, _ARRAY) and head == "{":
                self.open_call("")
                self._mode = _OBJECT
            elif self._mode == _ARRAY and head == "]":
                self._mode = _END
            elif self._mode == _OBJECT:
                taken, was_call = self.feed_call(self._pending)
                self._pending = self._pending[taken:]
                if was_call is not None:
                    self._mode = _ARRAY if was_call and self._in_array else _END if was_call else _TEXT
            elif self._mode == _END:
                self._pending = ""
            else:
                self._mode = _TEXT
                self.emit_content(self._pending)
                self._pending = ""
