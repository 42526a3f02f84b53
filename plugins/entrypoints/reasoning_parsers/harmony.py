"""``openai_gptoss``: gpt-oss's harmony format, where each message of the answer names its channel::

    <|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>

The generation prompt ends with ``<|start|>assistant``, so the answer begins with the first message's header.
The ``analysis`` channel is thinking; ``final`` (and ``commentary`` written to the user) is the answer. A
message addressed to a tool (``to=functions.NAME`` in its header) is a tool call: it is passed on to the answer
as harmony text (``<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>``), for the
``openai`` tool-call parser to read. The markers are special tokens, so answers are decoded with them kept.
An answer that is not harmony (no header within the first few hundred characters) is all answer.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from pagoda.plugins.entrypoints.reasoning_parsers.text_stream import StreamingReasoningParser, TokenText, partial_marker

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
MAX_HEADER_CHARS = 256  # a header this long without <|message|> is not harmony

_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def read_header(header: str) -> tuple[Optional[str], Optional[str]]:
    """A message header's channel and recipient (None where it names none)."""
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class HarmonyMessages:
    """Harmony text read as a stream of messages: ``on_header(channel, recipient)`` when a header is complete,
    ``on_body(text)`` for the body's pieces, ``on_end(marker)`` at its end. Text that is not harmony goes to
    ``on_body`` of a message with no channel."""

    _HEADER, _BODY, _BETWEEN, _PLAIN = "header", "body", "between", "plain"

    def __init__(self, on_header, on_body, on_end) -> None:
        self.on_header, self.on_body, self.on_end = on_header, on_body, on_end
        self._mode = self._HEADER
        self.pending = ""

    def read(self, is_final: bool) -> None:
        while self.pending:
            if self._mode == self._HEADER:
                at = self.pending.find(MESSAGE)
                if at < 0:
                    if len(self.pending) > MAX_HEADER_CHARS or is_final:
                        self._mode = self._PLAIN  # not harmony: the text is the answer
                        self.on_header(None, None)
                        continue
                    return
                self.on_header(*read_header(self.pending[:at]))
                self.pending = self.pending[at + len(MESSAGE):]
                self._mode = self._BODY
            elif self._mode in (self._BODY, self._PLAIN):
                ends = [(self.pending.find(m), m) for m in MESSAGE_ENDS if m in self.pending]
                if ends:
                    at, marker = min(ends)
                    self.on_body(self.pending[:at])
                    self.on_end(marker)
                    self.pending = self.pending[at + len(marker):]
                    self._mode = self._BETWEEN
                    continue
                keep = 0 if is_final else partial_marker(self.pending, MESSAGE_ENDS)
                self.on_body(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return
            else:  # between messages: the next one starts with <|start|> (its role follows, in its header)
                at = self.pending.find(START)
                if at < 0:
                    keep = 0 if is_final else partial_marker(self.pending, (START,))
                    self.pending = self.pending[len(self.pending) - keep:]
                    return
                self.pending = self.pending[at + len(START):]
                self._mode = self._HEADER


class HarmonyReasoningParser(StreamingReasoningParser):
    """``analysis`` messages are thinking; the others the answer, tool calls kept as harmony text."""

    skip_special_tokens = False

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self._messages = HarmonyMessages(self._header, self._body, self._end)
        self._is_thinking = False
        self._is_call = False
        self._token_text = TokenText()

    def reasoning_end(self, token_ids: Sequence[int], tokenizer) -> Optional[int]:
        """How many of the answer's first ids come before its answer: through the ``<|message|>`` of the first
        message that is not an ``analysis`` one (the ``final`` message, a preamble, a tool call); None until one
        begins. An answer that is not harmony is all answer (0)."""
        text = self._token_text.update(token_ids, tokenizer)
        head = text.lstrip()
        if head and not any(head.startswith(m) or m.startswith(head) for m in (CHANNEL, START)) \
                or MESSAGE not in text[:MAX_HEADER_CHARS + len(MESSAGE)] and len(text) > MAX_HEADER_CHARS:
            return 0  # not harmony: all answer
        at = text.find(MESSAGE)
        while at >= 0:
            header = text[max(text.rfind(START, 0, at), text.rfind(MESSAGE, 0, at) + 1, 0):at]
            channel, recipient = read_header(header)
            if channel != "analysis" or recipient is not None:
                return self._token_text.num_tokens_through(at + len(MESSAGE))
            at = text.find(MESSAGE, at + 1)
        return None

    def read(self, is_final: bool) -> None:
        self._messages.pending += self._pending
        self._pending = ""
        self._messages.read(is_final)

    def _header(self, channel: Optional[str], recipient: Optional[str]) -> None:
        self._is_call = recipient is not None
        self._is_thinking = channel == "analysis" and not self._is_call
        if self._is_call:
            self._content.append(f"{START}assistant to={recipient}{CHANNEL}{channel or 'commentary'}{MESSAGE}")

    def _body(self, text: str) -> None:
        if text:
            (self._reasoning if self._is_thinking else self._content).append(text)

    def _end(self, marker: str) -> None:
        if self._is_call:
            self._content.append("<|call|>")
        self._is_call = False
