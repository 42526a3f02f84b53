"""Shortest job first: waiting requests are admitted in order of prompt length.

Prompt length is the one job size known on arrival. Short prompts get their
first token sooner; a long prompt waits while shorter ones keep arriving, so
this policy trades tail latency of long requests for mean latency.
"""

from __future__ import annotations

from pagoda.scheduling import SchedulingPolicy
from pagoda.sequence import Sequence


class ShortestJobFirstScheduler(SchedulingPolicy):
    """pagoda's scheduler with its waiting queue ordered by prompt length (the ``waiting_key`` hook)."""

    def waiting_key(self, request: Sequence) -> tuple[bool, int, float]:
        # a preempted request already holds its place: it resumes before anything new starts;
        # new arrivals go by prompt length, ties in arrival order
        return (request.num_preemptions == 0, request.num_prompt_tokens, request.arrival_time)
