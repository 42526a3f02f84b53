"""Structured outputs under speculative decoding: the bitmask rows of a verified run of drafts.

A request with drafts ``d_0..d_{k-1}`` is scored at k + 1 positions. Row 0 holds the tokens the grammar allows
after the committed tokens (the engine's row); row j + 1 the tokens it allows after ``d_0..d_j``. The matcher
accepts the drafts one by one to fill those rows and is rolled back afterwards: the tokens the rejection sampler
keeps are committed by ``Sequence.append_output_tokens`` like any others, so the matcher always stands at the
committed tokens (a preempted or re-run step finds it there).

A draft the grammar refuses is masked out of its own row, so the target gives it probability 0 and the
rejection sampler rejects it there; the rows after it are never read and stay all-allowed.

A draft model steers its drafts with :class:`DraftGrammars`: a fork of each drafting sequence's matcher masks the
draft's logits at every proposed position, so the drafts fit the grammar as the target's tokens will; the forks
are dropped after drafting and the sequences' own matchers are not touched.
"""

from __future__ import annotations

import typing
from typing import Any, Optional

import torch

from pagoda.sampling.structured.bitmask import allocate_bitmask, apply_bitmask_


def fill_draft_rows(matcher: Any, draft_token_ids: typing.Sequence[int], bitmask: torch.Tensor,
                    first_row: int) -> int:
    """Fill ``bitmask`` rows ``first_row + 1 .. first_row + k``: the tokens allowed after each prefix of the
    ``k`` drafts (row ``first_row``, before the first draft, is the caller's). Returns how many drafts the
    grammar accepts in a row; the matcher ends where it began."""
    num_valid = 0
    for j, token_id in enumerate(draft_token_ids):
        # a refused draft ends the run; after the grammar's end (an accepted end-of-sequence) nothing follows
        if not matcher.accept_tokens([token_id]):
            break
        num_valid += 1
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, first_row + j + 1)
    matcher.rollback(num_valid)
    return num_valid


class DraftGrammars:
    """The grammars of one step's drafting, row for row of the requests being drafted: a fork of each one's
    matcher (none for a request without a grammar, or whose matcher cannot fork), advanced over its drafts as
    they are chosen and thrown away with this object."""

    def __init__(self, matchers: typing.Sequence[Optional[Any]], vocab_size: int) -> None:
        self.forks = [m.fork() if m is not None else None for m in matchers]
        self.vocab_size = vocab_size

    @property
    def is_steering(self) -> bool:
        return any(f is not None for f in self.forks)

    def mask_(self, logits: torch.Tensor, rows: typing.Sequence[int]) -> None:
        """Set to -inf, in place, the logits of the tokens each row's grammar does not allow next. ``logits``:
        ``[len(rows), vocab]``, line ``j`` the next draft position of row ``rows[j]``."""
        lines = [j for j, row in enumerate(rows) if self.forks[row] is not None]
        if not lines:
            return
        bitmask = allocate_bitmask(len(lines), self.vocab_size)  # [len(lines), words]
        for k, j in enumerate(lines):
            self.forks[rows[j]].fill_bitmask(bitmask, k)
        index = torch.tensor(lines)
        masked = logits[index]
        apply_bitmask_(masked, bitmask)
        logits[index] = masked

    def accept(self, row: int, token_id: int) -> bool:
        """Advance ``row``'s fork over its new draft. False when no draft may follow it: the draft ends the
        grammar (an end-of-sequence token), or the grammar refuses it."""
        fork = self.forks[row]
        if fork is None:
            return True
        return fork.accept_tokens([token_id]) and not fork.is_terminated()
