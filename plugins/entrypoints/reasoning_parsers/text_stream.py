"""What the reasoning parsers share: text read as a stream, with the end that may begin a marker held back."""

from __future__ import annotations

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
