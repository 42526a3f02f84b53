"""Reading one JSON object as it is generated, a piece at a time, noting where each top-level member's value lies.

A tool call is written as an object such as ``{"name": "get_weather", "arguments": {"city": "Paris"}}``; to
stream it, a parser must know the name as soon as its string closes, and which characters belong to the
arguments while they are still arriving. :class:`JsonObjectScanner` is strict about the object's top level
(keys, colons, commas) and follows only strings and brackets inside values; ``json.loads`` of the finished
text is the final word on validity.
"""

from __future__ import annotations

import bisect
import json
from typing import Any, Optional

WHITESPACE = " \t\n\r"
_PRIMITIVE_START = "-0123456789tfn"  # numbers, true, false, null
_PRIMITIVE_CHARS = "+-.0123456789eEtruefalsn"

# where the scanner is in the object's top level
_OPEN = "open"  # before the "{"
_KEY_OR_END = "key-or-end"  # after "{": a key or "}"
_KEY = "key"  # after ",": a key
_IN_KEY = "in-key"
_COLON = "colon"
_VALUE = "value"  # after ":": a value begins
_IN_VALUE = "in-value"  # inside a string, object or array value
_IN_PRIMITIVE = "in-primitive"  # inside a number, true, false or null
_AFTER_VALUE = "after-value"  # "," or "}"
_DONE = "done"
_INVALID = "invalid"


class JsonObjectScanner:
    """One JSON object, fed a piece at a time. ``members`` maps each finished top-level key to the
    ``(start, end)`` span of its value in ``text``; ``open_key`` is the key whose value is being read and
    ``open_value_start`` where that value began."""

    def __init__(self) -> None:
        self.members: dict[str, tuple[int, int]] = {}
        self.open_key: Optional[str] = None
        self.open_value_start = 0
        self._pieces: list[str] = []  # the text read, as fed (joined only where needed: reading stays linear)
        self._piece_starts: list[int] = []
        self._length = 0
        self._decoded: dict[str, Any] = {}
        self._state = _OPEN
        self._depth = 0  # brackets open inside the current value
        self._in_string = False
        self._escaped = False
        self._key_start = 0

    @property
    def text(self) -> str:
        """The object's text read so far."""
        if len(self._pieces) > 1:
            self._pieces, self._piece_starts = ["".join(self._pieces)], [0]
        return self._pieces[0] if self._pieces else ""

    def text_between(self, start: int, end: Optional[int] = None) -> str:
        """``text[start:end]``, joining only the pieces it spans."""
        end = self._length if end is None else end
        if start >= end:
            return ""
        first = max(0, bisect.bisect_right(self._piece_starts, start) - 1)
        last = bisect.bisect_left(self._piece_starts, end)
        offset = self._piece_starts[first]
        return "".join(self._pieces[first:last])[start - offset:end - offset]

    @property
    def is_done(self) -> bool:
        return self._state == _DONE

    @property
    def is_invalid(self) -> bool:
        return self._state == _INVALID

    @property
    def is_reading_value(self) -> bool:
        """Whether the string, object or array value of ``open_key`` is being read."""
        return self._state == _IN_VALUE

    def feed(self, chunk: str) -> int:
        """Read ``chunk``; returns how many of its characters belong to the object (fewer than all when the
        object closed, or stopped being JSON, inside it)."""
        if self._state in (_DONE, _INVALID) or not chunk:
            return 0
        start = self._length
        self._pieces.append(chunk)
        self._piece_starts.append(start)
        self._length += len(chunk)
        for i, ch in enumerate(chunk):
            self._step(ch, start + i)
            if self._state in (_DONE, _INVALID):
                self._pieces[-1] = chunk[:i + 1]
                self._length = start + i + 1
                return i + 1
        return len(chunk)

    def finish(self) -> None:
        """The text ended: a number at the very end of the text is complete only now."""
        if self._state == _IN_PRIMITIVE:
            self._end_value(self._length)

    def member(self, key: str) -> Any:
        """The decoded value of a finished top-level member, or None (absent, unfinished or not JSON)."""
        if key not in self._decoded and key in self.members:
            try:
                self._decoded[key] = json.loads(self.member_text(key))
            except ValueError:
                self._decoded[key] = None
        return self._decoded.get(key)

    def member_text(self, key: str) -> Optional[str]:
        span = self.members.get(key)
        return None if span is None else self.text_between(*span)

    def is_valid(self) -> bool:
        """Whether the finished object is JSON."""
        if not self.is_done:
            return False
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True

    # ---- the state machine ----------------------------------------------------------------------

    def _step(self, ch: str, pos: int) -> None:
        state = self._state
        if state == _IN_VALUE:
            self._step_in_value(ch, pos)
        elif state == _IN_KEY:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                try:
                    self.open_key = json.loads(self.text_between(self._key_start, pos + 1))
                except ValueError:
                    self._state = _INVALID
                    return
                self._state = _COLON
        elif ch in WHITESPACE and state != _IN_PRIMITIVE:
            return
        elif state == _OPEN:
            self._state = _KEY_OR_END if ch == "{" else _INVALID
        elif state in (_KEY_OR_END, _KEY):
            if ch == '"':
                self._state, self._key_start = _IN_KEY, pos
            elif ch == "}" and state == _KEY_OR_END:
                self._state = _DONE
            else:
                self._state = _INVALID
        elif state == _COLON:
            self._state = _VALUE if ch == ":" else _INVALID
        elif state == _VALUE:
            self.open_value_start = pos
            if ch in "{[":
                self._state, self._depth = _IN_VALUE, 1
            elif ch == '"':
                self._state, self._depth, self._in_string = _IN_VALUE, 0, True
            elif ch in _PRIMITIVE_START:
                self._state = _IN_PRIMITIVE
            else:
                self._state = _INVALID
        elif state == _IN_PRIMITIVE:
            if ch not in _PRIMITIVE_CHARS:
                self._end_value(pos)
                self._step(ch, pos)
        elif state == _AFTER_VALUE:
            if ch == ",":
                self._state = _KEY
            elif ch == "}":
                self._state = _DONE
            else:
                self._state = _INVALID

    def _step_in_value(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 0:  # a string value ended
                    self._end_value(pos + 1)
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value(pos + 1)

    def _end_value(self, end: int) -> None:
        self.members[self.open_key] = (self.open_value_start, end)
        self.open_key = None
        self._state = _AFTER_VALUE
