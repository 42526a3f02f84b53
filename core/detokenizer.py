"""Incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any, Optional

from pagoda.sampling_params import SamplingParams

# prompt tokens decoded along with the output so the first output token gets its leading space right
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text a token at a time.

    Text is only emitted once it no longer ends in an incomplete UTF-8
    character (U+FFFD). Stop strings are searched in the new text plus the
    tail that could start one.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""
        self.max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        ) if ids else ""

    def add_tokens(self, token_ids: list[int], may_stop: bool) -> Optional[str]:
        """Append tokens; returns the stop string hit (text truncated at it), or None.

        ``may_stop``: whether a stop string may end the sequence now (the sequence decides, see
        :meth:`pagoda.request.Request.may_stop_at`); the text grows either way.
        """
        self.ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.params.stop_strings or not may_stop:
            return None
        best: Optional[tuple[int, str]] = None
        for stop in self.params.stop_strings:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        if finished or self.max_stop_len <= 1 or self.params.include_stop_str_in_output:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]
