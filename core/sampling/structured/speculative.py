"""Structured outputs under speculative decoding: the bitmask rows of a verified run of drafts.

A request with drafts ``d_0..d_{k-1}`` is scored at k + 1 positions. Row 0 holds the tokens the grammar allows
after the committed tokens (the engine's row); row j + 1 the tokens it allows after ``d_0..d_j``. The matcher
accepts the drafts one by one to fill those rows and is rolled back afterwards: the tokens the rejection sampler
keeps are committed by ``Sequence.append_output_tokens`` like any others, so the matcher always stands at the
committed tokens (a preempted or re-run step finds it there).

A draft the grammar refuses is masked out of its own row, so the target gives it probability 0 and the
rejection sampler rejects it there; the rows after it are never read and stay all-allowed.
"""

from __future__ import annotations

import typing
from typing import Any

import torch


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
