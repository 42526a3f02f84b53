"""Shortest job first: waiting requests are admitted in order of prompt length.

Prompt length is the one job size known on arrival. Short prompts get their
first token sooner; a long prompt waits while shorter ones keep arriving, so
this policy trades tail latency of long requests for mean latency.
"""

from __future__ import annotations

import bisect

from pagoda.plugins.schedulers.base import TokenBudgetScheduler
from pagoda.sequence import Sequence


def _job_size(request: Sequence) -> tuple[int, float]:
    # ties keep arrival order
    return (request.num_prompt_tokens, request.arrival_time)


class ShortestJobFirstScheduler(TokenBudgetScheduler):
    """The token-budget scheduler with its waiting queue kept sorted by prompt length."""

    def _insert_waiting(self, request: Sequence, front: bool = False) -> None:
        if front:
            # a preempted request already holds its place: it resumes before anything new starts
            self.waiting.insert(0, request)
            return
        # preempted requests sit at the front; new arrivals are ordered among the rest
        first_new = next((i for i, r in enumerate(self.waiting) if r.num_preemptions == 0), len(self.waiting))
        index = bisect.bisect_right(self.waiting, _job_size(request), lo=first_new, key=_job_size)
        self.waiting.insert(index, request)
