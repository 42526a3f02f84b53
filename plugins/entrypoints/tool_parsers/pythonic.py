"""``pythonic``: an answer that is a Python list of calls, as Llama 3.2 and Gemma with a pythonic tool template
write them::

    [get_weather(city="Paris"), add(a=1, b=2)]

The answer is calls when, stripped of whitespace, it is such a list whose calls name the request's tools with
keyword arguments of literal values (strings, numbers, booleans, None, lists, dicts); the arguments become a JSON
object. Any other answer is content, as written. Streamed, an answer that starts with ``[`` is held back until
it ends (a list is only known to be calls when it closes), then sent as calls or as content.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Optional

from pagoda.tool_calls import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, new_tool_call_id


class PythonicToolParser:
    """A :class:`pagoda.interfaces.ToolParser` for ``[name(arg=value, ...), ...]`` answers."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.tool_names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
        self._held = ""
        self._is_holding: Optional[bool] = None  # None until the first character that is not whitespace

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        calls = self._calls(model_output)
        if calls is None:
            return ExtractedToolCalls(model_output)
        return ExtractedToolCalls(None, [ToolCall(new_tool_call_id(), name, arguments) for name, arguments in calls])

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        if self._is_holding is False:
            return DeltaMessage(delta_text)
        self._held += delta_text
        stripped = self._held.lstrip()
        if not stripped:
            return DeltaMessage()
        self._is_holding = stripped.startswith("[")
        if self._is_holding:
            return DeltaMessage()
        held, self._held = self._held, ""
        return DeltaMessage(held)

    def finish_streaming(self) -> DeltaMessage:
        held, self._held = self._held, ""
        calls = self._calls(held) if self._is_holding else None
        if calls is None:
            return DeltaMessage(held)
        return DeltaMessage("", [ToolCallDelta(i, new_tool_call_id(), name, arguments)
                                 for i, (name, arguments) in enumerate(calls)])

    def _calls(self, text: str) -> Optional[list[tuple[str, str]]]:
        """The calls ``(name, arguments as JSON text)`` the answer is, or None when it is not a list of calls."""
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and node.func.id in self.tool_names and all(k.arg for k in node.keywords)):
                return None
            try:
                arguments = json.dumps({k.arg: _literal(k.value) for k in node.keywords}, ensure_ascii=False)
            except (ValueError, TypeError):  # not a literal, or one JSON cannot hold (bytes, a set)
                return None
            calls.append((node.func.id, arguments))
        return calls


def _literal(node: ast.AST) -> Any:
    """A literal's value (ValueError for anything else); ``true``, ``false`` and ``null`` as JSON's."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)
