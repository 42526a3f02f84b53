"""What the reasoning parsers share: text read as a stream, with the end that may begin a marker held back."""

from __future__ import annotations

import bisect

from pagoda.reasoning import ReasoningDelta, join_reasoning


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers`` (to hold back)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class StreamingReasoningParser:
    """A :class:`pagoda.interfaces.ReasoningParser` whose subclass reads pending text in :meth:`read`; a whole
    answer is read by streaming it in one piece, so the two reads cannot disagree."""

    skip_special_tokens = True

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt
        self._pending = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def extract_reasoning(self, model_output: str) -> ReasoningDelta:
        whole = type(self)(self.prompt)
        return join_reasoning([whole.extract_reasoning_streaming(model_output), whole.finish_streaming()])

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        self._pending += delta_text
        self.read(is_final=False)
        return self._take()

    def finish_streaming(self) -> ReasoningDelta:
        self.read(is_final=True)
        return self._take()

    def read(self, is_final: bool) -> None:
        """Move what can be decided of ``self._pending`` into the reasoning or the content."""
        raise NotImplementedError

    def _take(self) -> ReasoningDelta:
        delta = ReasoningDelta("".join(self._reasoning), "".join(self._content))
        self._reasoning, self._content = [], []
        return delta


class TokenText:
    """The text of an answer's token ids as they grow, each id decoded once (special tokens kept): what the
    token-level ``reasoning_end`` of the parsers reads. A list that no longer extends the last one (a rollback)
    is decoded again from where they differ."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.ends: list[int] = []  # ends[i]: the length of the text of ids[:i + 1]
        self.text = ""

    def update(self, token_ids, tokenizer) -> str:
        token_ids = list(token_ids)
        same = len(self.ids) if token_ids[:len(self.ids)] == self.ids else _common_prefix(self.ids, token_ids)
        if same < len(self.ids):
            del self.ids[same:], self.ends[same:]
            self.text = self.text[:self.ends[-1]] if self.ends else ""
        for token_id in token_ids[same:]:
            self.text += tokenizer.decode([token_id], skip_special_tokens=False)
            self.ids.append(token_id)
            self.ends.append(len(self.text))
        return self.text

    def num_tokens_through(self, position: int) -> int:
        """How many ids the text up to ``position`` (exclusive) needs: the first ids whose text reaches it."""
        return bisect.bisect_left(self.ends, position) + 1 if position > 0 else 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
