"""What the built-in tool-call parsers share: calls written as JSON objects with a name and arguments.

A subclass says where in the text the objects are (between tags, at the start, ...) and hands each object's
text to :meth:`JsonToolCallParser.feed_call`; this base reads the object with a
:class:`~pagoda.plugins.entrypoints.tool_parsers.json_scanner.JsonObjectScanner`, begins the call (its id and
name) as soon as the name is read, and streams the arguments' text as it arrives. A whole answer is read by
streaming it in one piece, so the two reads cannot disagree.
"""

from __future__ import annotations

from typing import Optional

from pagoda.plugins.entrypoints.tool_parsers.json_scanner import WHITESPACE, JsonObjectScanner
from pagoda.tool_calls import DeltaMessage, ExtractedToolCalls, ToolCallDelta, join_deltas, new_tool_call_id


class _Call:
    """One call being read: its object, the text before it that belongs to it (an opening tag), and what of it
    has been sent."""

    def __init__(self, prefix: str) -> None:
        self.scanner = JsonObjectScanner()
        self.prefix = prefix
        self.index: Optional[int] = None  # set when the call begins (its name is read and accepted)
        self.num_arguments_sent = 0  # characters of the arguments' text sent


class JsonToolCallParser:
    """A :class:`pagoda.interfaces.ToolParser` for calls written as ``{"name": ..., "<arguments key>": ...}``.

    Arguments given as an object (or array) are streamed as the model writes them; as a JSON string, they
    are sent decoded when the string closes; left out or null, they are ``"{}"``. An object that is not JSON,
    or whose name is missing or not accepted, is content, as long as nothing of it was sent; once its name
    was sent, the call stands with the arguments sent (a call cut off by ``max_tokens`` ends that way).
    """

    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.tool_names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
        self.num_calls = 0
        self.call: Optional[_Call] = None
        self._content: list[str] = []
        self._calls: dict[int, list[ToolCallDelta]] = {}

    # ---- the ToolParser protocol --------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        whole = type(self)(self.tools)
        return join_deltas([whole.extract_tool_calls_streaming(model_output), whole.finish_streaming()])

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self.read(delta_text, is_final=False)
        return self.take()

    def finish_streaming(self) -> DeltaMessage:
        self.read("", is_final=True)
        if self.call is not None:
            self.call.scanner.finish()
            self.close_call()
        return self.take()

    # ---- for subclasses -----------------------------------------------------------------------------

    def read(self, text: str, is_final: bool) -> None:
        """Take the next piece of text (``is_final``: the answer ends after it)."""
        raise NotImplementedError

    def accepts(self, name: str) -> bool:
        """Whether an object naming ``name`` is a call (otherwise it is content)."""
        return True

    def emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def open_call(self, prefix: str) -> None:
        self.call = _Call(prefix)

    def feed_call(self, text: str) -> tuple[int, Optional[bool]]:
        """Feed the open call's object; returns how many characters of ``text`` it took and, when the object
        ended (closed, or stopped being JSON), whether it was a call (False: its text went out as content)."""
        call = self.call
        taken = call.scanner.feed(text)
        self._advance(call)
        if call.scanner.is_done or call.scanner.is_invalid:
            return taken, self.close_call()
        return taken, None

    def close_call(self) -> bool:
        """End the open call: send the rest of its arguments, or, if it never began, its text as content."""
        call, self.call = self.call, None
        self._advance(call)
        if call.index is None:
            self.emit_content(call.prefix + call.scanner.text)
            return False
        rest = self._final_arguments(call)
        if rest is not None:
            self._add(ToolCallDelta(call.index, arguments=rest))
        return True

    def take(self) -> DeltaMessage:
        """What was read since the last call: content, and one delta per call."""
        deltas = []
        for index, pieces in self._calls.items():
            first = next((p for p in pieces if p.id is not None), None)
            deltas.append(ToolCallDelta(index, first.id if first else None, first.name if first else None,
                                        "".join(p.arguments for p in pieces)))
        message = DeltaMessage("".join(self._content), deltas)
        self._content, self._calls = [], {}
        return message

    # ---- the call's name and arguments --------------------------------------------------------------

    def _advance(self, call: _Call) -> None:
        if call.index is None:
            name = call.scanner.member("name")
            if not isinstance(name, str) or not name or not self.accepts(name):
                return
            call.index = self.num_calls
            self.num_calls += 1
            self._add(ToolCallDelta(call.index, new_tool_call_id(), name, ""))
        span = self._object_arguments(call.scanner)
        if span is not None:
            fragment = call.scanner.text_between(span[0] + call.num_arguments_sent, span[1])
            if fragment:
                self._add(ToolCallDelta(call.index, arguments=fragment))
                call.num_arguments_sent += len(fragment)

    def _object_arguments(self, scanner: JsonObjectScanner) -> Optional[tuple[int, Optional[int]]]:
        """Where the arguments' text lies, ``(start, end)`` (end None while it is being read), when they are an
        object or array: those are sent as they arrive."""
        key = next((k for k in self.argument_keys if k in scanner.members), None)
        if key is not None:
            start, end = scanner.members[key]
        elif scanner.open_key in self.argument_keys and scanner.is_reading_value:
            start, end = scanner.open_value_start, None
        else:
            return None
        return (start, end) if scanner.text_between(start, start + 1) in ("{", "[") else None

    def _final_arguments(self, call: _Call) -> Optional[str]:
        """The arguments still to send when the call ends: None when they were sent as they arrived."""
        scanner = call.scanner
        if self._object_arguments(scanner) is not None:
            return None  # an object or array, sent already (all of it, or what was written of it)
        key = next((k for k in self.argument_keys if k in scanner.members), None)
        if key is None:
            return "{}"
        value = scanner.member(key)
        if isinstance(value, str):
            return value  # arguments written as a JSON string holding the JSON
        text = scanner.member_text(key)
        return "{}" if text.strip() == "null" else text

    def _add(self, delta: ToolCallDelta) -> None:
        self._calls.setdefault(delta.index, []).append(delta)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (to hold them back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def skip_whitespace(text: str) -> int:
    """How many characters at the start of ``text`` are whitespace."""
    return len(text) - len(text.lstrip(WHITESPACE))
