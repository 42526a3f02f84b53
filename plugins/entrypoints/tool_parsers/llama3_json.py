"""``llama3_json``: an answer that is a JSON call, as Llama 3.1 and later write them with JSON tool calling::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The answer is a call when it starts (after whitespace and an optional ``<|python_tag|>``, which is gone when
special tokens are skipped) with an object naming one of the request's tools; further calls may follow,
separated by ``;`` or whitespace. Any other answer is content, as written: a JSON answer such as
``{"answer": 4}`` included.
"""

from __future__ import annotations

from pagoda.plugins.entrypoints.tool_parsers.base import JsonToolCallParser, held_back
from pagoda.plugins.entrypoints.tool_parsers.json_scanner import WHITESPACE

PYTHON_TAG = "<|python_tag|>"

_START = "start"  # whitespace and the python tag, until the first other character decides
_OBJECT = "object"
_BETWEEN = "between"  # after a call: separators, then another call or the end
_TEXT = "text"  # content to the end


class Llama3JsonToolParser(JsonToolCallParser):
    """``{"name": ..., "parameters": ...}`` (``arguments`` is read too) at the start of the answer."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._mode = _START
        self._pending = ""
        self._prefix = ""  # what _START read: content if no call follows

    def accepts(self, name: str) -> bool:
        return name in self.tool_names

    def read(self, text: str, is_final: bool) -> None:
        self._pending += text
        while self._pending:
            if self._mode == _START:
                if self._pending.startswith(PYTHON_TAG):
                    self._prefix += PYTHON_TAG
                    self._pending = self._pending[len(PYTHON_TAG):]
                elif self._pending[0] in WHITESPACE:
                    self._prefix += self._pending[0]
                    self._pending = self._pending[1:]
                elif self._pending[0] == "{":
                    self.open_call(self._prefix)
                    self._mode = _OBJECT
                elif not is_final and held_back(self._pending, PYTHON_TAG) == len(self._pending):
                    break  # may be the python tag
                else:
                    self._to_text(self._prefix)
            elif self._mode == _OBJECT:
                taken, was_call = self.feed_call(self._pending)
                self._pending = self._pending[taken:]
                if was_call is not None:
                    self._mode = _BETWEEN if was_call else _TEXT
            elif self._mode == _BETWEEN:
                if self._pending[0] in WHITESPACE + ";":
                    self._pending = self._pending[1:]
                elif self._pending[0] == "{":
                    self.open_call("")
                    self._mode = _OBJECT
                else:
                    self._to_text("")
            else:
                self.emit_content(self._pending)
                self._pending = ""
        if is_final and self._mode == _START:
            self.emit_content(self._prefix + self._pending)
            self._pending = ""

    def _to_text(self, before: str) -> None:
        self.emit_content(before)
        self._mode = _TEXT
