"""``hermes``: calls between tags, one JSON object each, as Hermes 2 Pro, Qwen2.5 and many others write them::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content, less the whitespace next to a tag. A model that ends after the object
without the closing tag still made the call.
"""

from __future__ import annotations

from pagoda.plugins.entrypoints.tool_parsers.base import JsonToolCallParser, held_back, skip_whitespace
from pagoda.plugins.entrypoints.tool_parsers.json_scanner import WHITESPACE

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

_TEXT = "text"
_BEFORE_OBJECT = "before-object"  # after the opening tag
_OBJECT = "object"
_AFTER_OBJECT = "after-object"  # the closing tag is due


class HermesToolParser(JsonToolCallParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, any number of times."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._mode = _TEXT
        self._pending = ""  # text read and not yet used
        self._held_whitespace = ""  # content whitespace that may turn out to sit next to a tag
        self._drop_whitespace = False  # after a call: the whitespace that follows it is not content

    def read(self, text: str, is_final: bool) -> None:
        self._pending += text
        while self._pending:
            if self._mode == _TEXT:
                if not self._read_text(is_final):
                    break
            elif self._mode == _BEFORE_OBJECT:
                skip = skip_whitespace(self._pending)
                self.call.prefix += self._pending[:skip]
                self._pending = self._pending[skip:]
                if not self._pending:
                    break
                if self._pending[0] == "{":
                    self._mode = _OBJECT
                else:  # no object after the tag: the tag was text
                    call, self.call = self.call, None
                    self._emit_text(call.prefix)
                    self._mode = _TEXT
            elif self._mode == _OBJECT:
                taken, was_call = self.feed_call(self._pending)
                self._pending = self._pending[taken:]
                if was_call is not None:
                    self._mode = _AFTER_OBJECT if was_call else _TEXT
                    self._drop_whitespace = was_call
            else:  # _AFTER_OBJECT
                self._pending = self._pending[skip_whitespace(self._pending):]
                if self._pending.startswith(CLOSE_TAG):
                    self._pending = self._pending[len(CLOSE_TAG):]
                elif not self._pending or (not is_final and CLOSE_TAG.startswith(self._pending)):
                    break  # the tag may yet come
                self._mode = _TEXT  # the tag, or text without it
        if is_final and self._mode == _TEXT:
            self._emit_text(self._pending)
            self._pending = ""
            if not self.num_calls:
                self.emit_content(self._held_whitespace)
            self._held_whitespace = ""

    def _read_text(self, is_final: bool) -> bool:
        """Content up to the next opening tag; False when the rest must wait for more text."""
        start = self._pending.find(OPEN_TAG)
        if start < 0:
            keep = 0 if is_final else held_back(self._pending, OPEN_TAG)
            self._emit_text(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._emit_text(self._pending[:start])
        self.open_call(self._held_whitespace + OPEN_TAG)
        self._held_whitespace = ""
        self._pending = self._pending[start + len(OPEN_TAG):]
        self._mode = _BEFORE_OBJECT
        return True

    def _emit_text(self, text: str) -> None:
        """Content, holding back trailing whitespace (it may precede a tag) and dropping what follows a call."""
        if self._drop_whitespace:
            text = text[skip_whitespace(text):]
            self._drop_whitespace = not text
        text = self._held_whitespace + text
        body = text.rstrip(WHITESPACE)
        self.emit_content(body)
        self._held_whitespace = text[len(body):]
