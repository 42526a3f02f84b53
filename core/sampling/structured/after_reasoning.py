"""Structured outputs after the thinking: a matcher that holds a reasoning model's answer, not its thinking.

With a reasoning parser, a request's constraint (a JSON schema, a regex, a forced tool call, ...) applies to
the answer only. :class:`AfterReasoning` wraps the request's matcher: while the model thinks it is *waiting*
(the engine gives the request no bitmask row, and the tokens it accepts only grow the thinking); once the
parser's ``reasoning_end`` finds the end of the thinking in the generated ids (``</think>``, gpt-oss's switch
to its final channel), the grammar starts from its initial state on the tokens after that end. Speculative
drafts during the thinking are unconstrained; a verified run of drafts that ends the thinking is constrained
from the draft after the end (the runner asks :meth:`AfterReasoning.starts_within`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

ReasoningEnd = Callable[[Sequence[int]], Optional[int]]


class AfterReasoning:
    """A :class:`pagoda.interfaces.StructuredOutputMatcher` that starts where the thinking ends.

    ``reasoning_end(ids)``: how many of the answer's first ids the thinking takes (its end marker included),
    None while it goes on. Every accepted token is either thinking or the inner matcher's, in order, so a
    rollback undoes the right ones.
    """

    def __init__(self, matcher: Any, reasoning_end: ReasoningEnd) -> None:
        self.matcher = matcher
        self.reasoning_end = reasoning_end
        self.thinking: list[int] = []  # the ids accepted while waiting
        self.num_inner = 0  # the ids accepted by the inner matcher since it started
        self.is_waiting = True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for k, token_id in enumerate(token_ids):
            if not self.is_waiting:
                return self._accept_inner(token_ids[k:])
            self.thinking.append(token_id)
            end = self.reasoning_end(self.thinking)
            if end is not None:
                self.is_waiting = False
                # a marker read on text may end inside the ids already accepted: they start the answer
                after, self.thinking = self.thinking[end:], self.thinking[:end]
                if after and not self._accept_inner(after):
                    self.thinking.extend(after)
                    self.is_waiting = True
                    return False
        return True

    def _accept_inner(self, token_ids: list[int]) -> bool:
        if not self.matcher.accept_tokens(token_ids):
            return False
        self.num_inner += len(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        inner = min(num_tokens, self.num_inner)
        if inner:
            self.matcher.rollback(inner)
            self.num_inner -= inner
        thinking = num_tokens - inner
        if thinking:
            del self.thinking[len(self.thinking) - thinking:]
            self.is_waiting = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_waiting:
            bitmask[row].fill_(-1)  # the thinking is free
        else:
            self.matcher.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return not self.is_waiting and self.matcher.is_terminated()

    def may_end(self) -> bool:
        # while thinking the end token is thinking's last token (accepted): the answer is then empty
        return not self.is_waiting and self.matcher.may_end()

    def fork(self) -> Optional["AfterReasoning"]:
        inner = self.matcher.fork()
        if inner is None:
            return None
        copy = AfterReasoning(inner, self.reasoning_end)
        copy.thinking, copy.num_inner, copy.is_waiting = list(self.thinking), self.num_inner, self.is_waiting
        return copy

    def starts_within(self, draft_token_ids: Sequence[int]) -> bool:
        """Whether the thinking ends within these drafts (the ones after it are then held to the grammar)."""
        return self.is_waiting and bool(draft_token_ids) and \
            self.reasoning_end(self.thinking + list(draft_token_ids)) is not None


def is_waiting(matcher: Any) -> bool:
    """Whether a sequence's matcher waits for the thinking to end (it samples without a grammar meanwhile)."""
    return isinstance(matcher, AfterReasoning) and matcher.is_waiting


def after_reasoning(matcher: Any, parser: Any, tokenizer: Any) -> Any:
    """``matcher``, started where ``parser`` (a ``pagoda_reasoning_parsers`` parser made for the request's
    prompt) finds the thinking's end; ``matcher`` itself when the answer has no thinking (the prompt switched
    it off)."""
    def reasoning_end(token_ids: Sequence[int]) -> Optional[int]:
        return parser.reasoning_end(token_ids, tokenizer)

    if reasoning_end([]) == 0:
        return matcher
    return AfterReasoning(matcher, reasoning_end)
