"""``deepseek_r1`` and ``qwen3``: thinking between ``<think>`` and ``</think>``, then the answer::

    <think>
    The user greets me; greet back.
    </think>

    Hello!

DeepSeek-R1's chat template opens the thinking in the prompt, so its answers often hold only the closing
tag: ``deepseek_r1`` reads an answer as thinking from its first character (an opening tag there is dropped)
until ``</think>``, and an answer that never closes it as thinking only. ``qwen3`` reads thinking only when the
answer opens it (or its prompt did); an answer without ``<think>`` is all answer, as Qwen3 writes with
``enable_thinking`` false (its template then closes an empty thinking block in the prompt). An answer cut off
while thinking is thinking only, with both.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagoda.plugins.entrypoints.reasoning_parsers.text_stream import StreamingReasoningParser, TokenText, partial_marker

START_TAG = "<think>"
END_TAG = "</think>"

_START = "start"  # before the answer's first text: it may open the thinking
_THINKING = "thinking"
_AFTER_THINKING = "after-thinking"  # the whitespace after </think> is not part of the answer
_ANSWER = "answer"


def prompt_state(prompt: str) -> str | None:
    """Where the prompt leaves the answer: thinking (its template opened ``<think>`` last), answering (it closed
    a thinking block last, after the last turn began), or None (it says nothing)."""
    start, end = prompt.rfind(START_TAG), prompt.rfind(END_TAG)
    if start < 0 and end < 0:
        return None
    if start > end:
        return _THINKING if not prompt[start + len(START_TAG):].strip(" \n") else None
    return _AFTER_THINKING if not prompt[end + len(END_TAG):].strip(" \n") else None


class ThinkTagReasoningParser(StreamingReasoningParser):
    """``<think>…</think>`` then the answer; ``starts_thinking``: an answer without the opening tag is thinking
    (DeepSeek-R1) rather than answer (Qwen3)."""

    starts_thinking = False

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self._mode = prompt_state(prompt) or _START
        # the prompt closed the thinking (Qwen3's enable_thinking false): the answer is all answer
        self.may_think = self._mode != _AFTER_THINKING
        self._token_text = TokenText()

    def reasoning_end(self, token_ids: Sequence[int], tokenizer) -> Optional[int]:
        """How many of the answer's first ids the thinking takes, ``</think>`` included (0: the answer has no
        thinking), or None while it goes on. Read on the ids' text, so a tag written in several tokens counts."""
        if self._mode == _AFTER_THINKING:
            return 0
        text = self._token_text.update(token_ids, tokenizer)
        start = 0
        if self._mode == _START:
            head = text.lstrip(" \n")
            if not head.startswith(START_TAG):
                if START_TAG.startswith(head):
                    return None  # nothing yet, or the start of the tag
                if not self.starts_thinking:  # Qwen3: all answer, from its first text that is not blank
                    return self._token_text.num_tokens_through(len(text) - len(head) + 1) - 1
            else:
                start = len(text) - len(head) + len(START_TAG)
        end = text.find(END_TAG, start)
        return None if end < 0 else self._token_text.num_tokens_through(end + len(END_TAG))

    def read(self, is_final: bool) -> None:
        while self._pending:
            if self._mode == _START:
                head = self._pending.lstrip(" \n")
                if head.startswith(START_TAG):
                    self._pending = head[len(START_TAG):]
                    self._mode = _THINKING
                elif not is_final and START_TAG.startswith(head):
                    return  # it may yet be the tag
                else:
                    self._mode = _THINKING if self.starts_thinking else _ANSWER
            elif self._mode == _THINKING:
                end = self._pending.find(END_TAG)
                if end >= 0:
                    self._reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(END_TAG):]
                    self._mode = _AFTER_THINKING
                    continue
                keep = 0 if is_final else partial_marker(self._pending, (END_TAG,))
                self._reasoning.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return
            elif self._mode == _AFTER_THINKING:
                self._pending = self._pending.lstrip(" \n")
                if self._pending:
                    self._mode = _ANSWER
            else:
                self._content.append(self._pending)
                self._pending = ""


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 and its distillations: thinking from the start until ``</think>``."""

    starts_thinking = True


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3: thinking only inside ``<think>…</think>`` at the start of the answer."""

    starts_thinking = False
